package kube

import (
	"context"
	"errors"
	"io"
	"maps"
	"slices"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// The broker's copy of a workspace (on its own disk, where signed links,
// uploads, resources and commits read it) and each pod's copy are kept in
// step by sync: it compares both sides with what the last sync saw, pulls
// what only the pod changed and pushes what the broker's side changed
// (which wins when both did). Paths go through os.Root on both sides
// (workspace.Workspace), and the broker's quota holds: a pod whose files
// pass it is not pulled from at all.

const (
	syncTimeout = 5 * time.Minute
	getBatch    = 1000 // paths per get request
)

// errNotReached wraps a sync that could not reach the agent: nothing
// changed on either side.
var errNotReached = agent.ErrNotReached

// syncLocked syncs p with the workspace w. Caller holds the session lock.
// It returns the quota error (QUOTA_EXCEEDED, nothing pulled) when the
// pod's files pass the quota, and an error wrapping agent.ErrNotReached
// when the agent cannot be reached.
func (s *Session) syncLocked(ctx context.Context, w *workspace.Workspace, p *pod) error {
	ctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	list, err := p.client.Manifest(ctx)
	if err != nil {
		return err
	}
	podNow := make(map[string]agent.ManifestEntry, len(list))
	var total int64
	for _, e := range list {
		podNow[e.Path] = e
		total += e.Size
	}
	lim := w.Limits()
	if len(podNow) > lim.MaxFiles || total > lim.MaxBytes {
		return quotaError(lim)
	}
	hostNow, err := w.Snapshot()
	if err != nil {
		return err
	}
	hostChanged := map[string]bool{}
	for path, st := range hostNow {
		if old, ok := p.hostMark[path]; !ok || !old.Equal(st) {
			hostChanged[path] = true
		}
	}
	for path := range p.hostMark {
		if _, ok := hostNow[path]; !ok {
			hostChanged[path] = true
		}
	}
	var pull, pullDel []string
	for path, e := range podNow {
		if old, ok := p.podMark[path]; (!ok || old != e) && !hostChanged[path] {
			if e.Size > lim.MaxFileBytes {
				return brokererr.New(brokererr.FileSizeExceeded, "%s is larger than %d bytes", path, lim.MaxFileBytes)
			}
			pull = append(pull, path)
		}
	}
	for path := range p.podMark {
		if _, ok := podNow[path]; !ok && !hostChanged[path] {
			pullDel = append(pullDel, path)
		}
	}
	slices.Sort(pull)
	for batch := range slices.Chunk(pull, getBatch) {
		err := p.client.Get(ctx, batch, lim.MaxFileBytes, func(path string, size int64, r io.Reader) error {
			_, err := w.WriteFrom(ctx, path, r, max(size, 1), true)
			return err
		})
		if err != nil {
			return err
		}
	}
	for _, path := range pullDel {
		if err := w.Remove(path); err != nil {
			return err
		}
	}
	newPodMark := maps.Clone(podNow)
	if len(pull)+len(pullDel) > 0 {
		hostAfter, err := w.Snapshot()
		if err != nil {
			return err
		}
		for _, path := range pull {
			hostNow[path] = hostAfter[path]
		}
		for _, path := range pullDel {
			delete(hostNow, path)
		}
	}
	var push, pushDel []string
	for path := range hostChanged {
		if _, ok := hostNow[path]; ok {
			push = append(push, path)
		} else if _, ok := podNow[path]; ok {
			pushDel = append(pushDel, path)
		}
	}
	if len(push)+len(pushDel) > 0 {
		slices.Sort(push)
		after, err := p.client.Put(ctx, push, pushDel, func(path string) (io.ReadCloser, int64, error) {
			f, fi, err := w.OpenFile(path)
			if err != nil {
				return nil, 0, err
			}
			return f, fi.Size(), nil
		})
		if err != nil {
			return err
		}
		podAfter := make(map[string]agent.ManifestEntry, len(after))
		for _, e := range after {
			podAfter[e.Path] = e
		}
		// Only what was pushed takes the pod's new stamps: anything else
		// that changed meanwhile (a job writing) is pulled next time.
		for _, path := range push {
			if e, ok := podAfter[path]; ok {
				newPodMark[path] = e
			}
		}
		for _, path := range pushDel {
			delete(newPodMark, path)
		}
	}
	p.podMark, p.hostMark = newPodMark, hostNow
	return nil
}

// quotaError is the QUOTA_EXCEEDED of a pod whose files pass the quota.
func quotaError(l workspace.Limits) error {
	return brokererr.New(brokererr.QuotaExceeded,
		"the workspace exceeded its quota (%d files, %d MiB); the run was stopped and the files it wrote were removed", l.MaxFiles, l.MaxBytes>>20)
}

// isQuota reports a sync refused for the quota or a file's size.
func isQuota(err error) bool {
	c := brokererr.CodeOf(err)
	return c == brokererr.QuotaExceeded || c == brokererr.FileSizeExceeded
}

// unreachable reports a sync or call that never reached the agent.
func unreachable(err error) bool { return errors.Is(err, errNotReached) }
