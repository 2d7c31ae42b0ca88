package agent

import (
	"archive/tar"
	"bufio"
	"context"
	"crypto"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/sandbox-broker/sandbox-broker/services/workspace"
)

// PodClient is the broker's side of a pod-mode agent (pod.go, podops.go):
// every connection is mutual TLS, verified against the broker CA and the
// pod's name. What the agent sends is hostile: answers are bounded and
// decoded strictly, and paths are validated again.
type PodClient struct {
	Addr string      // the pod's IP and PodPort
	TLS  *tls.Config // RootCAs, ServerName (PodServerName) and the broker's client certificate
}

// Dial opens a verified connection; it is the Dialer for RunVia and
// StartJobVia.
func (p *PodClient) Dial(ctx context.Context) (net.Conn, error) {
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: 10 * time.Second}, Config: p.TLS}
	return d.DialContext(ctx, "tcp", p.Addr)
}

// Enroll hands the agent at addr its certificate chain (PEM), on a
// connection whose server key must be pin (the key of the request the
// agent published in its log); base carries the broker's client
// certificate.
func Enroll(ctx context.Context, addr string, base *tls.Config, pin crypto.PublicKey, chainPEM []byte) error {
	cfg := base.Clone()
	cfg.InsecureSkipVerify = true // the key is pinned instead, below
	cfg.VerifyConnection = func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return errors.New("agent: no server certificate")
		}
		k, ok := cs.PeerCertificates[0].PublicKey.(interface{ Equal(crypto.PublicKey) bool })
		if !ok || !k.Equal(pin) {
			return errors.New("agent: the server key is not the one the pod published")
		}
		return nil
	}
	p := &PodClient{Addr: addr, TLS: cfg}
	_, err := p.call(ctx, PodRequest{Op: OpCert, Cert: string(chainPEM)}, nil)
	return err
}

// Manifest lists the pod workspace's regular files.
func (p *PodClient) Manifest(ctx context.Context) ([]ManifestEntry, error) {
	return p.call(ctx, PodRequest{Op: OpManifest}, nil)
}

// Put writes the files named in paths (read with open) into the pod's
// workspace and removes the paths in remove; it returns the manifest
// afterwards.
func (p *PodClient) Put(ctx context.Context, paths, remove []string, open func(path string) (io.ReadCloser, int64, error)) ([]ManifestEntry, error) {
	return p.call(ctx, PodRequest{Op: OpPut, Remove: remove}, func(w io.Writer) error {
		tw := tar.NewWriter(w)
		for _, path := range paths {
			r, size, err := open(path)
			if err != nil {
				return err
			}
			err = tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: path, Size: size, Mode: 0o644, Format: tar.FormatPAX})
			if err == nil {
				_, err = io.CopyN(tw, r, size)
			}
			r.Close()
			if err != nil {
				return err
			}
		}
		return tw.Close()
	})
}

// Get fetches the regular files in paths; fn receives each that the agent
// sends, at most maxFile bytes, in any order. Files gone since they were
// listed are simply missing. An entry the broker did not ask for, or asked
// for once and got twice, is an error.
func (p *PodClient) Get(ctx context.Context, paths []string, maxFile int64, fn func(path string, size int64, r io.Reader) error) error {
	want := make(map[string]bool, len(paths))
	for _, path := range paths {
		want[path] = true
	}
	c, err := p.open(ctx, PodRequest{Op: OpGet, Paths: paths})
	if err != nil {
		return err
	}
	defer c.Close()
	tr := tar.NewReader(bufio.NewReaderSize(c, 64<<10))
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return ctxErr(ctx, fmt.Errorf("agent: read files: %w", err))
		}
		if h.Typeflag != tar.TypeReg || !want[h.Name] || h.Size < 0 || h.Size > maxFile {
			return fmt.Errorf("agent: unexpected file entry %q (%d bytes)", truncate(h.Name, 100), h.Size)
		}
		delete(want, h.Name)
		if err := fn(h.Name, h.Size, tr); err != nil {
			return err
		}
	}
}

// Tunnel opens an egress tunnel for the job whose EgressTunnel is token.
// It returns once the agent has claimed it for one of the job's
// connections (see tunnel.go); until then it waits, bounded by ctx.
func (p *PodClient) Tunnel(ctx context.Context, token string) (net.Conn, error) {
	c, err := p.open(ctx, PodRequest{Op: OpEgress, Tunnel: token})
	if err != nil {
		return nil, err
	}
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	var b [1]byte
	_, err = io.ReadFull(c, b[:])
	if !stop() || err != nil || b[0] != '\n' {
		c.Close()
		if err == nil {
			err = errors.New("agent: tunnel refused")
		}
		return nil, ctxErr(ctx, err)
	}
	return c, nil
}

// open dials and sends req's line; the deadline is ctx's.
func (p *PodClient) open(ctx context.Context, req PodRequest) (net.Conn, error) {
	c, err := p.Dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrNotReached, err)
	}
	if d, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(d)
	}
	if err := writeJSONLine(c, req); err != nil {
		c.Close()
		return nil, ctxErr(ctx, err)
	}
	return c, nil
}

// call sends req (and body, if set) and reads a PodAnswer.
func (p *PodClient) call(ctx context.Context, req PodRequest, body func(io.Writer) error) ([]ManifestEntry, error) {
	c, err := p.open(ctx, req)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Now()) })
	defer stop()
	if body != nil {
		bw := bufio.NewWriterSize(c, 64<<10)
		if err := body(bw); err != nil {
			return nil, ctxErr(ctx, err)
		}
		if err := bw.Flush(); err != nil {
			return nil, ctxErr(ctx, err)
		}
	}
	line, err := readLine(bufio.NewReaderSize(c, 64<<10), MaxResponseBytes)
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	var ans PodAnswer
	if err := decodeStrict(line, &ans); err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	if ans.Error != "" {
		return nil, fmt.Errorf("agent: %s", truncate(ans.Error, 300))
	}
	return checkManifest(ans.Files)
}

// checkManifest validates the agent's list: valid, distinct paths and
// sizes that are not negative.
func checkManifest(files []ManifestEntry) ([]ManifestEntry, error) {
	if len(files) > MaxManifestFiles {
		return nil, fmt.Errorf("agent: manifest of %d files", len(files))
	}
	seen := make(map[string]bool, len(files))
	for _, f := range files {
		if _, err := workspace.ValidatePath(f.Path); err != nil || seen[f.Path] || f.Size < 0 {
			return nil, fmt.Errorf("agent: bad manifest entry %q", truncate(f.Path, 100))
		}
		seen[f.Path] = true
	}
	return files, nil
}

func writeJSONLine(c net.Conn, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if len(b)+1 > MaxRequestBytes {
		return fmt.Errorf("agent: request of %d bytes exceeds %d", len(b)+1, MaxRequestBytes)
	}
	_, err = c.Write(append(b, '\n'))
	return err
}
