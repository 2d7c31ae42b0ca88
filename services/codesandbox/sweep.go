package codesandbox

import (
	"context"
	"slices"
	"time"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

const (
	// defaultSweepGrace spares sandboxes younger than this: one may be
	// between its fork and the projects table's row for it.
	defaultSweepGrace = 15 * time.Minute
	// sweepPageSize is GET /sandbox's largest page; sweepMaxPages bounds
	// one sweep's listing.
	sweepPageSize = 50
	sweepMaxPages = 100
)

// Sweep deletes hosted sandboxes that carry the broker's tag but that
// known reports the broker does not know: left behind by a crash between
// fork and bookkeeping, or by a lost state database. Sandboxes this
// provider holds open, and those younger than SweepGrace, are spared; so
// is everything when known fails. It returns how many it deleted.
//
// Every broker sharing a CodeSandbox workspace must use its own Tag:
// another broker's sandboxes are unknown to this one.
func (p *Provider) Sweep(ctx context.Context, known func(ctx context.Context, id string) (bool, error)) (int, error) {
	if err := p.checkOpen(); err != nil {
		return 0, err
	}
	return SweepTagged(ctx, p.c, SweepOptions{Tag: p.o.Tag, Grace: p.o.SweepGrace, Holds: p.holds, Known: known, Destroy: p.Destroy, Log: p.log})
}

// SweepOptions say which sandboxes SweepTagged may delete and how.
type SweepOptions struct {
	Tag     string        // only sandboxes with this tag are candidates
	Grace   time.Duration // younger ones are spared
	Holds   func(id string) bool
	Known   func(ctx context.Context, id string) (bool, error)
	Destroy func(ctx context.Context, id string) error
	Log     zerolog.Logger
}

// SweepTagged lists the sandboxes tagged o.Tag and destroys those older
// than o.Grace that are neither held nor known. The listing is read in
// full before the first deletion, so deleting does not shift its pages;
// when Known fails nothing more is deleted.
func SweepTagged(ctx context.Context, c *Client, o SweepOptions) (int, error) {
	var candidates []string
	cutoff := time.Now().Add(-o.Grace)
	for page := 1; ; page++ {
		if page > sweepMaxPages {
			o.Log.Warn().Int("pages", sweepMaxPages).Msg("csb_sweep_truncated")
			break
		}
		l, err := c.ListSandboxes(ctx, ListOptions{Tags: []string{o.Tag}, PageSize: sweepPageSize, Page: page, OrderBy: "inserted_at", Direction: "asc"})
		if err != nil {
			return 0, err
		}
		for _, sb := range l.Sandboxes {
			if ValidSandboxID(sb.ID) && slices.Contains(sb.Tags, o.Tag) && !sb.CreatedAt.IsZero() && sb.CreatedAt.Before(cutoff) && !o.Holds(sb.ID) {
				candidates = append(candidates, sb.ID)
			}
		}
		if l.Pagination.NextPage == nil || *l.Pagination.NextPage <= page {
			break
		}
	}
	deleted := 0
	for _, id := range candidates {
		ok, err := o.Known(ctx, id)
		if err != nil {
			return deleted, brokererr.Wrap(err, brokererr.Unavailable, "cannot tell which sandboxes the broker knows")
		}
		if ok || o.Holds(id) {
			continue
		}
		if err := o.Destroy(ctx, id); err != nil {
			o.Log.Warn().Str("sandbox_id", id).Str("error_code", string(brokererr.CodeOf(err))).Msg("csb_orphan_delete_failed")
			continue
		}
		deleted++
		o.Log.Info().Str("sandbox_id", id).Msg("csb_orphan_deleted")
	}
	return deleted, nil
}

// holds reports whether the provider has sandbox id open.
func (p *Provider) holds(id string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	_, ok := p.vms[id]
	return ok
}
