package codesandbox

import (
	"context"
	"slices"
	"time"

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
// is everything when known fails. The listing is read in full before the
// first deletion, so deleting does not shift its pages. It returns how
// many sandboxes it deleted.
//
// Every broker sharing a CodeSandbox workspace must use its own Tag:
// another broker's sandboxes are unknown to this one.
func (p *Provider) Sweep(ctx context.Context, known func(ctx context.Context, id string) (bool, error)) (int, error) {
	if err := p.checkOpen(); err != nil {
		return 0, err
	}
	var candidates []string
	cutoff := time.Now().Add(-p.o.SweepGrace)
	for page := 1; ; page++ {
		if page > sweepMaxPages {
			p.log.Warn().Int("pages", sweepMaxPages).Msg("csb_sweep_truncated")
			break
		}
		l, err := p.c.ListSandboxes(ctx, ListOptions{Tags: []string{p.o.Tag}, PageSize: sweepPageSize, Page: page, OrderBy: "inserted_at", Direction: "asc"})
		if err != nil {
			return 0, err
		}
		for _, sb := range l.Sandboxes {
			if ValidSandboxID(sb.ID) && slices.Contains(sb.Tags, p.o.Tag) && !sb.CreatedAt.IsZero() && sb.CreatedAt.Before(cutoff) && !p.holds(sb.ID) {
				candidates = append(candidates, sb.ID)
			}
		}
		if l.Pagination.NextPage == nil || *l.Pagination.NextPage <= page {
			break
		}
	}
	deleted := 0
	for _, id := range candidates {
		ok, err := known(ctx, id)
		if err != nil {
			return deleted, brokererr.Wrap(err, brokererr.Unavailable, "cannot tell which sandboxes the broker knows")
		}
		if ok || p.holds(id) {
			continue
		}
		if err := p.Destroy(ctx, id); err != nil {
			p.log.Warn().Str("sandbox_id", id).Str("error_code", string(brokererr.CodeOf(err))).Msg("csb_orphan_delete_failed")
			continue
		}
		deleted++
		p.log.Info().Str("sandbox_id", id).Msg("csb_orphan_deleted")
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
