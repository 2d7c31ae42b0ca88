package agent

import (
	"archive/tar"
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// Pod-mode operations. In pod mode the workspace is a volume of the pod's
// own, so the broker keeps its copy in step through these (the kubernetes
// backend's sync); every path goes through the workspace package's
// os.Root-confined access on both sides, and the broker treats what the
// agent sends as hostile (sizes capped, names validated again). The first
// line of a connection names the op:
//
//	{"op":"cert","cert":PEM}     install the broker-issued certificate → PodAnswer
//	{"op":"manifest"}            → PodAnswer with Files
//	{"op":"get","paths":[…]}     → a tar stream of those regular files (missing ones left out)
//	{"op":"put","remove":[…]}    then a tar stream of regular files to write → PodAnswer with Files
//	{"op":"egress","tunnel":T}   park this connection as an egress tunnel of job T (tunnel.go)
const (
	OpCert     = "cert"
	OpManifest = "manifest"
	OpGet      = "get"
	OpPut      = "put"
	OpEgress   = "egress"
)

// PodRequest is the first line of a pod-mode operation.
type PodRequest struct {
	Op     string   `json:"op"`
	Cert   string   `json:"cert,omitempty"`
	Paths  []string `json:"paths,omitempty"`
	Remove []string `json:"remove,omitempty"`
	Tunnel string   `json:"tunnel,omitempty"`
}

// PodAnswer answers cert, manifest and put.
type PodAnswer struct {
	Files []ManifestEntry `json:"files,omitempty"`
	Error string          `json:"error,omitempty"`
}

// ManifestEntry is one regular file of the pod's workspace.
type ManifestEntry struct {
	Path    string `json:"p"`
	Size    int64  `json:"s"`
	MTimeNS int64  `json:"m"`
	Inode   uint64 `json:"i,omitempty"`
}

// MaxManifestFiles bounds a manifest (and a get or put's path list); a
// workspace with more files is refused as a whole.
const MaxManifestFiles = 20_000

// podFileLimits are the agent's own bounds on the pod workspace; the
// broker's quota is tighter and is enforced on its side.
var podFileLimits = workspace.Limits{MaxFiles: MaxManifestFiles, MaxBytes: 1 << 40, MaxFileBytes: 1 << 32}

// podOp returns the handler for a pod-mode first line, or nil when the
// line is not one (or the agent is not in pod mode).
func (s *Server) podOp(line []byte) func(ctx context.Context, c net.Conn, br *bufio.Reader) {
	if s.opts.Pod == nil {
		return nil
	}
	var req PodRequest
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if dec.Decode(&req) != nil || dec.More() {
		return nil
	}
	switch req.Op {
	case OpCert:
		return func(_ context.Context, c net.Conn, _ *bufio.Reader) {
			ans := PodAnswer{}
			if err := s.opts.Pod.install([]byte(req.Cert)); err != nil {
				ans.Error = err.Error()
			}
			writeAnswer(c, ans)
		}
	case OpManifest:
		return func(_ context.Context, c net.Conn, _ *bufio.Reader) { writeAnswer(c, s.manifest()) }
	case OpGet:
		return func(ctx context.Context, c net.Conn, _ *bufio.Reader) { s.sendFiles(ctx, c, req.Paths) }
	case OpPut:
		return func(ctx context.Context, c net.Conn, br *bufio.Reader) {
			writeAnswer(c, s.receiveFiles(ctx, c, br, req.Remove))
		}
	case OpEgress:
		return func(_ context.Context, c net.Conn, br *bufio.Reader) {
			_ = c.SetDeadline(time.Time{})
			if !sandbox.ValidID(req.Tunnel) || !s.tunnels.park(req.Tunnel, &bufferedConn{Conn: c, r: br}) {
				_ = c.SetWriteDeadline(time.Now().Add(time.Second))
				_, _ = c.Write([]byte("unknown tunnel\n"))
			}
		}
	}
	return nil
}

func writeAnswer(c net.Conn, a PodAnswer) {
	b, err := json.Marshal(a)
	if err != nil {
		b, _ = json.Marshal(PodAnswer{Error: err.Error()})
	}
	_ = c.SetWriteDeadline(time.Now().Add(30 * time.Second))
	_, _ = c.Write(append(b, '\n'))
}

func (s *Server) openWorkspace() (*workspace.Workspace, error) {
	return workspace.Open(s.opts.WorkDir, podFileLimits, workspace.WithOwner(-1, -1))
}

// manifest lists the workspace's regular files.
func (s *Server) manifest() PodAnswer {
	w, err := s.openWorkspace()
	if err != nil {
		return PodAnswer{Error: err.Error()}
	}
	defer w.Close()
	snap, err := w.Snapshot()
	if err != nil {
		return PodAnswer{Error: err.Error()}
	}
	if len(snap) > MaxManifestFiles {
		return PodAnswer{Error: fmt.Sprintf("the workspace holds more than %d files", MaxManifestFiles)}
	}
	files := make([]ManifestEntry, 0, len(snap))
	for p, st := range snap {
		files = append(files, ManifestEntry{Path: p, Size: st.Size, MTimeNS: st.ModTime.UnixNano(), Inode: st.Inode})
	}
	slices.SortFunc(files, func(a, b ManifestEntry) int { return strings.Compare(a.Path, b.Path) })
	return PodAnswer{Files: files}
}

// sendFiles writes a tar stream of the regular files among paths. A file
// that changes size while it is sent ends the stream early (the broker
// sees a broken archive and retries the sync).
func (s *Server) sendFiles(ctx context.Context, c net.Conn, paths []string) {
	if len(paths) > MaxManifestFiles {
		return
	}
	w, err := s.openWorkspace()
	if err != nil {
		return
	}
	defer w.Close()
	_ = c.SetWriteDeadline(time.Time{})
	tw := tar.NewWriter(c)
	for _, p := range paths {
		if ctx.Err() != nil {
			return
		}
		f, fi, err := w.OpenFile(p)
		if err != nil {
			continue // gone since the manifest: the next one says so
		}
		err = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: p, Size: fi.Size(), Mode: 0o644, ModTime: fi.ModTime(), Format: tar.FormatPAX})
		if err == nil {
			_, err = io.CopyN(tw, f, fi.Size())
		}
		f.Close()
		if err != nil {
			return
		}
	}
	_ = tw.Close()
}

// receiveFiles writes the tar stream's regular files into the workspace
// (through os.Root, replacing what is there) and removes the paths in
// remove; it answers with the manifest afterwards.
func (s *Server) receiveFiles(ctx context.Context, c net.Conn, br *bufio.Reader, remove []string) PodAnswer {
	if len(remove) > MaxManifestFiles {
		return PodAnswer{Error: "too many paths"}
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Minute))
	w, err := s.openWorkspace()
	if err != nil {
		return PodAnswer{Error: err.Error()}
	}
	defer w.Close()
	tr := tar.NewReader(br)
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return PodAnswer{Error: "read archive: " + err.Error()}
		}
		if n >= MaxManifestFiles || h.Typeflag != tar.TypeReg {
			return PodAnswer{Error: "bad archive entry"}
		}
		if _, err := w.WriteFrom(ctx, h.Name, tr, h.Size, true); err != nil {
			return PodAnswer{Error: fmt.Sprintf("write %s: %v", truncate(h.Name, 100), err)}
		}
	}
	for _, p := range remove {
		if err := w.Remove(p); err != nil {
			return PodAnswer{Error: fmt.Sprintf("remove %s: %v", truncate(p, 100), err)}
		}
	}
	return s.manifest()
}
