package hosted

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// The host workspace is the source of truth. Before a command, push makes
// the VM's workspace match it: files the broker wrote there since the last
// sync (write_file, signed uploads, a run that fell back to Docker) go to
// the VM, files deleted there are deleted in the VM. After a command, pull
// copies back what the helper saw the command create, change or delete.
// Files come back through workspace.Write: a path that leaves the
// workspace, a symlink in the way, a file over the size cap or a workspace
// over its quota are refused there, as for any writer.

// openWorkspace opens (creating) the session's host workspace. Its files
// get the workspace directory's owner, so a Docker session that falls
// back onto it finds them its own.
func (s *Session) openWorkspace() (*workspace.Workspace, error) {
	w, err := workspace.Open(s.ref.Dir, s.b.o.WorkspaceLimits, workspace.WithDirOwner())
	if brokererr.CodeOf(err) == brokererr.SandboxNotFound {
		return workspace.Create(s.ref.Dir, workspace.WithLimits(s.b.o.WorkspaceLimits), workspace.WithOwner(-1, -1))
	}
	return w, err
}

// vmPath is a workspace-relative path inside the VM's workspace.
func (v *vm) vmPath(rel string) string { return path.Join(v.ws, rel) }

// push makes the VM's workspace match the host's; notes collects files it
// could not copy. A failure leaves the VM unknown, so the next push starts
// over.
func (s *Session) push(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, notes *[]string) error {
	v := s.v
	v.syncMu.Lock()
	defer v.syncMu.Unlock()
	now, err := w.Snapshot()
	if err != nil {
		return err
	}
	var changed, deleted []string
	if !v.known {
		if err := s.clearVM(ctx, conn); err != nil {
			v.known, v.base = false, nil
			return err
		}
		changed = slices.Sorted(maps.Keys(now))
	} else {
		changed = workspace.Changed(v.base, now)
		for p := range v.base {
			if _, ok := now[p]; !ok {
				deleted = append(deleted, p)
			}
		}
	}
	v.known = false // until the copy is complete
	for _, p := range deleted {
		if err := conn.Remove(ctx, v.vmPath(p), false); err != nil && !notFound(err) {
			return codesandbox.AgentError(err)
		}
	}
	made := map[string]bool{}
	for _, p := range changed {
		if now[p].Size > s.b.o.MaxSyncFileBytes {
			*notes = append(*notes, fmt.Sprintf("%s (%d bytes) was not copied into the hosted VM: files over %d bytes stay on the broker", p, now[p].Size, s.b.o.MaxSyncFileBytes))
			delete(now, p)
			continue
		}
		f, err := w.Read(p, 0, s.b.o.MaxSyncFileBytes)
		if err != nil {
			delete(now, p) // changed or gone since the walk: next time
			continue
		}
		if dir := path.Dir(p); dir != "." && !made[dir] {
			if err := conn.Mkdir(ctx, v.vmPath(dir), true); err != nil {
				return codesandbox.AgentError(err)
			}
			made[dir] = true
		}
		if err := conn.WriteFile(ctx, v.vmPath(p), f.Data); err != nil {
			return codesandbox.AgentError(err)
		}
	}
	v.known, v.base = true, now
	return nil
}

// clearVM empties the VM's workspace (the host's copy is pushed next).
func (s *Session) clearVM(ctx context.Context, conn *codesandbox.Pitcher) error {
	ents, err := conn.ReadDir(ctx, s.v.ws)
	if err != nil {
		return codesandbox.AgentError(err)
	}
	for _, e := range ents {
		if e.Name == "" || e.Name == "." || e.Name == ".." || strings.Contains(e.Name, "/") {
			continue
		}
		if err := conn.Remove(ctx, s.v.vmPath(e.Name), true); err != nil && !notFound(err) {
			return codesandbox.AgentError(err)
		}
	}
	return nil
}

func notFound(err error) bool {
	var pe *codesandbox.PitcherError
	return errors.As(err, &pe) && pe.NotFound()
}

// errSyncQuota is pull's error when the copy would overfill the workspace.
var errSyncQuota = errors.New("workspace quota")

// pull copies back what a command did to the VM's workspace and returns
// the host files it wrote. On a quota error the files this pull wrote are
// removed again, on both sides, and the error is QuotaExceeded; on any
// failure the VM's workspace is left unknown, so the next push makes it
// the host's again.
func (s *Session) pull(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, ch fileChanges, notes *[]string) ([]sandbox.FileInfo, error) {
	v := s.v
	v.syncMu.Lock()
	defer v.syncMu.Unlock()
	if ch.ManifestTruncated {
		v.known, v.base = false, nil
		l := w.Limits()
		return nil, brokererr.New(brokererr.QuotaExceeded, "the VM's workspace holds more than the %d entries the workspace quota allows; remove files and run again", l.MaxFiles)
	}
	for _, p := range ch.Skipped {
		if len(*notes) < 20 {
			*notes = append(*notes, p+" is not a regular file (a symlink, FIFO or device) and stays in the hosted VM only")
		}
	}
	host, err := w.Snapshot()
	if err != nil {
		v.known, v.base = false, nil
		return nil, err
	}
	for _, p := range ch.Deleted {
		// Only what the host still has as last synced: a newer host file
		// (an upload meanwhile) wins over the VM's deletion.
		if b, ok := v.base[p]; ok && host[p].Equal(b) {
			if err := w.Remove(p); err == nil || brokererr.CodeOf(err) == brokererr.FileNotFound {
				delete(v.base, p)
			}
		}
	}
	var wrote []string
	var failed error
	for _, c := range ch.Changed {
		rel, err := workspace.ValidatePath(c.Path)
		if err != nil || rel != c.Path {
			*notes = append(*notes, fmt.Sprintf("%q is not a name the broker keeps; it stays in the hosted VM only", cleanMessage(c.Path)))
			continue
		}
		if c.Size > s.b.o.MaxSyncFileBytes || c.Size < 0 {
			*notes = append(*notes, fmt.Sprintf("%s (%d bytes) stays in the hosted VM only: files over %d bytes are not copied back", rel, c.Size, s.b.o.MaxSyncFileBytes))
			continue
		}
		data, err := conn.ReadFile(ctx, v.vmPath(rel))
		switch {
		case notFound(err):
			continue // gone since the helper's walk
		case err != nil:
			failed = codesandbox.AgentError(err)
		case int64(len(data)) > s.b.o.MaxSyncFileBytes:
			*notes = append(*notes, fmt.Sprintf("%s grew past %d bytes and stays in the hosted VM only", rel, s.b.o.MaxSyncFileBytes))
			continue
		default:
			err = w.Write(rel, data, true)
			switch brokererr.CodeOf(err) {
			case "":
				wrote = append(wrote, rel)
				continue
			case brokererr.QuotaExceeded, brokererr.FileSizeExceeded:
				failed = errSyncQuota
			case brokererr.PathTraversal, brokererr.InvalidInput:
				*notes = append(*notes, fmt.Sprintf("%s could not be stored on the broker (%s) and stays in the hosted VM only", rel, brokererr.CodeOf(err)))
				continue
			default:
				failed = err
			}
		}
		break
	}
	if failed != nil {
		v.known, v.base = false, nil
		if errors.Is(failed, errSyncQuota) {
			s.undo(ctx, conn, w, ch)
			l := w.Limits()
			return nil, brokererr.New(brokererr.QuotaExceeded,
				"the run's files exceed the workspace quota (%d files, %d MiB); the files it wrote were removed", l.MaxFiles, l.MaxBytes>>20)
		}
		return nil, failed
	}
	after, err := w.Snapshot()
	if err != nil {
		v.known, v.base = false, nil
		return nil, err
	}
	out := make([]sandbox.FileInfo, 0, len(wrote))
	for _, p := range wrote {
		if st, ok := after[p]; ok {
			if v.base != nil {
				v.base[p] = st
			}
			out = append(out, sandbox.FileInfo{Path: p, Size: st.Size, ModTime: st.ModTime})
		}
	}
	return out, nil
}

// undo removes what a command wrote, from the host and from the VM.
func (s *Session) undo(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, ch fileChanges) {
	for _, c := range ch.Changed {
		if rel, err := workspace.ValidatePath(c.Path); err == nil && rel == c.Path {
			_ = w.Remove(rel)
			_ = conn.Remove(ctx, s.v.vmPath(rel), false)
		}
	}
}
