package hosted

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"path"
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
// could not copy. A failure leaves the VM unknown, so the next push
// reconciles the two sides.
func (s *Session) push(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, notes *[]string) error {
	v := s.v
	v.syncMu.Lock()
	defer v.syncMu.Unlock()
	switch {
	case v.fresh:
		// A new VM (or one reset): its workspace gives way to the host's.
		if err := s.clearVM(ctx, conn); err != nil {
			return err
		}
		v.fresh, v.known, v.base = false, true, nil
	case !v.known:
		return s.reconcile(ctx, conn, w, notes)
	}
	return s.pushAll(ctx, conn, w, notes)
}

// pushAll copies what changed on the host since base. Caller holds syncMu
// and has made the VM match base.
func (s *Session) pushAll(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, notes *[]string) error {
	v := s.v
	now, err := hostFiles(w)
	if err != nil {
		return err
	}
	changed := workspace.Changed(v.base, now)
	var deleted []string
	for p := range v.base {
		if _, ok := now[p]; !ok {
			deleted = append(deleted, p)
		}
	}
	v.known = false // until the copy is complete
	for _, p := range deleted {
		if err := s.removeVM(ctx, conn, p); err != nil {
			return err
		}
	}
	made := map[string]bool{}
	for _, p := range changed {
		if err := s.pushFile(ctx, conn, w, p, now, made, notes); err != nil {
			return err
		}
	}
	v.known, v.base = true, now
	return nil
}

// pushFile copies host file p into the VM; a file that cannot be read
// (gone, changed since the walk) or is over the sync cap leaves now.
func (s *Session) pushFile(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, p string, now map[string]workspace.FileStamp, made map[string]bool, notes *[]string) error {
	if now[p].Size > s.b.o.MaxSyncFileBytes {
		*notes = append(*notes, fmt.Sprintf("%s (%d bytes) was not copied into the hosted VM: files over %d bytes stay on the broker", p, now[p].Size, s.b.o.MaxSyncFileBytes))
		delete(now, p)
		return nil
	}
	f, err := w.Read(p, 0, s.b.o.MaxSyncFileBytes)
	if err != nil {
		delete(now, p) // the next push tries again
		return nil
	}
	if dir := path.Dir(p); dir != "." && !made[dir] {
		if err := conn.Mkdir(ctx, s.v.vmPath(dir), true); err != nil {
			return codesandbox.AgentError(err)
		}
		made[dir] = true
	}
	return codesandbox.AgentError(conn.WriteFile(ctx, s.v.vmPath(p), f.Data))
}

func (s *Session) removeVM(ctx context.Context, conn *codesandbox.Pitcher, p string) error {
	if err := conn.Remove(ctx, s.v.vmPath(p), false); err != nil && !notFound(err) {
		return codesandbox.AgentError(err)
	}
	return nil
}

// reconcile brings a VM and host that may both have changed since they
// last matched (a run whose outcome was lost, a broker restart) together
// again, file by file, with the host's stamps at the last sync (base) as
// the common ancestor: a side that changed a file since then wins, the
// host when both did (or when there is no base); a file only one side has
// was created there, or deleted on the other if base had it unchanged.
// Caller holds syncMu.
func (s *Session) reconcile(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, notes *[]string) error {
	v := s.v
	scan, err := s.scan(ctx, conn)
	if err != nil {
		return err
	}
	if scan.ManifestTruncated {
		// More than the quota allows: what the VM holds beyond the
		// host's copy is given up, as the process backend removes what a
		// run over the quota wrote.
		s.b.log.Warn().Str("sandbox_id", v.id()).Msg("csb_session_vm_over_quota_reset")
		if err := s.clearVM(ctx, conn); err != nil {
			return err
		}
		v.base = nil
		v.known = true
		return s.pushAll(ctx, conn, w, notes)
	}
	host, err := hostFiles(w)
	if err != nil {
		return err
	}
	inVM := map[string]changedFile{}
	for _, f := range scan.Changed {
		if rel, err := workspace.ValidatePath(f.Path); err == nil && rel == f.Path {
			inVM[f.Path] = f
		}
	}
	var toPull fileChanges
	var toPush, vmGone, hostGone []string
	for p, f := range inVM {
		h, onHost := host[p]
		b, inBase := v.base[p]
		unchangedOnHost := inBase && onHost && h.Equal(b)
		switch {
		case !onHost && inBase:
			vmGone = append(vmGone, p) // deleted on the host
		case !onHost, unchangedOnHost && !s.sameContent(w, p, f):
			toPull.Changed = append(toPull.Changed, f)
		case !s.sameContent(w, p, f):
			toPush = append(toPush, p)
		}
	}
	for p, h := range host {
		if _, ok := inVM[p]; ok {
			continue
		}
		if b, inBase := v.base[p]; inBase && h.Equal(b) {
			hostGone = append(hostGone, p) // deleted in the VM
		} else {
			toPush = append(toPush, p)
		}
	}
	for _, p := range vmGone {
		if err := s.removeVM(ctx, conn, p); err != nil {
			return err
		}
	}
	made := map[string]bool{}
	for _, p := range toPush {
		if err := s.pushFile(ctx, conn, w, p, host, made, notes); err != nil {
			return err
		}
	}
	for _, p := range hostGone {
		_ = w.Remove(p)
	}
	v.known, v.base = true, host
	if len(toPull.Changed) > 0 {
		if _, err := s.pullLocked(ctx, conn, w, toPull, notes); err != nil {
			return err
		}
	}
	if v.known {
		if v.base, err = hostFiles(w); err != nil {
			v.known = false
			return err
		}
	}
	s.b.log.Info().Str("sandbox_id", v.id()).Int("pulled", len(toPull.Changed)).Int("pushed", len(toPush)).
		Int("removed_vm", len(vmGone)).Int("removed_host", len(hostGone)).Msg("csb_session_reconciled")
	return nil
}

// sameContent compares host file p with the scan's hash of the VM's copy.
func (s *Session) sameContent(w *workspace.Workspace, p string, f changedFile) bool {
	if f.SHA256 == "" {
		return false
	}
	file, err := w.Read(p, 0, s.b.o.MaxSyncFileBytes)
	if err != nil || int64(len(file.Data)) != f.Size {
		return false
	}
	sum := sha256.Sum256(file.Data)
	return hex.EncodeToString(sum[:]) == f.SHA256
}

// scan runs the helper's scan of the VM's workspace.
func (s *Session) scan(ctx context.Context, conn *codesandbox.Pitcher) (*result, error) {
	id := newID()
	sp := spec{ID: id, Workspace: s.v.ws, MaxEntries: s.maxEntries(), MaxHash: s.b.o.MaxSyncFileBytes, Result: resultPath(id)}
	if err := writeSpec(ctx, conn, sp); err != nil {
		return nil, codesandbox.AgentError(err)
	}
	res, tail, err := s.runHelper(ctx, conn, "scan", id, 0)
	if errors.Is(err, errNoResult) {
		return nil, s.helperFailed(err, tail)
	}
	return res, codesandbox.AgentError(err)
}

// vmConfig is the VM's own configuration in its workspace (the runner
// template's setup tasks): never synced or cleared (helper.py VM_CONFIG).
const vmConfig = ".codesandbox"

// hostFiles snapshots the host workspace's files that sync (all but a
// vmConfig directory, which stays on the host).
func hostFiles(w *workspace.Workspace) (map[string]workspace.FileStamp, error) {
	snap, err := w.Snapshot()
	for p := range snap {
		if p == vmConfig || strings.HasPrefix(p, vmConfig+"/") {
			delete(snap, p)
		}
	}
	return snap, err
}

// clearVM empties the VM's workspace but for its configuration (the
// host's copy is pushed next).
func (s *Session) clearVM(ctx context.Context, conn *codesandbox.Pitcher) error {
	ents, err := conn.ReadDir(ctx, s.v.ws)
	if err != nil {
		return codesandbox.AgentError(err)
	}
	for _, e := range ents {
		if e.Name == "" || e.Name == "." || e.Name == ".." || e.Name == vmConfig || strings.Contains(e.Name, "/") {
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
	s.v.syncMu.Lock()
	defer s.v.syncMu.Unlock()
	return s.pullLocked(ctx, conn, w, ch, notes)
}

// pullLocked is pull; the caller holds syncMu.
func (s *Session) pullLocked(ctx context.Context, conn *codesandbox.Pitcher, w *workspace.Workspace, ch fileChanges, notes *[]string) ([]sandbox.FileInfo, error) {
	v := s.v
	if ch.ManifestTruncated {
		v.known, v.fresh = false, true // the next push resets the VM's workspace to the host's
		l := w.Limits()
		return nil, brokererr.New(brokererr.QuotaExceeded,
			"the run left more than the %d entries the workspace quota allows; the files it wrote were discarded", l.MaxFiles)
	}
	for _, p := range ch.Skipped {
		if len(*notes) < 20 {
			*notes = append(*notes, p+" is not a regular file (a symlink, FIFO or device) and stays in the hosted VM only")
		}
	}
	host, err := w.Snapshot()
	if err != nil {
		v.known = false
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
		v.known = false
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
		v.known = false
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
