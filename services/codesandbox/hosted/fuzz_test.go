package hosted

import (
	"bytes"
	"encoding/base64"
	"testing"

	"github.com/sandbox-broker/sandbox-broker/services/codesandbox"
)

// FuzzFrameReader: terminal output from an untrusted VM, cut anywhere,
// never panics, and a frame survives any cut and any noise around it
// (the command's own output never reaches the terminal: only the helper
// and the shell write there).
func FuzzFrameReader(f *testing.F) {
	f.Add([]byte("hello\x00world"), []byte("\x1b[?2004l[CODESANDBOX] x\r\n"), 3)
	f.Add([]byte{}, []byte("SBX1 O !!!\n"), 0)
	f.Add([]byte("\n\n"), []byte(""), 100)
	f.Fuzz(func(t *testing.T, data, noise []byte, cut int) {
		line := "SBX1 O " + base64.StdEncoding.EncodeToString(data) + "\r\n"
		noise = bytes.ReplaceAll(noise, []byte(framePrefix), nil)
		head := bytes.ReplaceAll(noise, []byte("\n"), []byte(" "))
		if bytes.Contains(codesandbox.CleanOutput(head), []byte(framePrefix)) {
			// Only the helper writes frames: noise that still reads as one
			// (the removal or an escape sequence joined its parts) is out.
			return
		}
		stream := string(head) + "\n" + line + string(noise)
		if cut < 0 {
			cut = -cut
		}
		cut %= len(stream) + 1
		var r frameReader
		var got [][]byte
		for _, chunk := range []string{stream[:cut], stream[cut:]} {
			r.feed(chunk, func(kind byte, d []byte) {
				if kind == frameStdout {
					got = append(got, append([]byte(nil), d...))
				}
			})
		}
		if len(got) == 0 || !bytes.Equal(got[0], data) {
			t.Fatalf("frame of %q lost or changed: %q", data, got)
		}
	})
}

// FuzzDecodeResult: a result file from the VM is decoded strictly; what
// passes keeps to the caps the broker relies on.
func FuzzDecodeResult(f *testing.F) {
	id := "0123456789abcdef0123456789abcdef"
	f.Add([]byte(`{"v":1,"id":"` + id + `","exit_code":3,"signal":"SIGKILL","stdout":"aGk=","changed":[{"path":"a","size":1,"mtime_ns":2}]}`))
	f.Add([]byte(`{"v":1,"id":"` + id + `","error":"tsx is not installed\u0000"}`))
	f.Add([]byte(`{"v":1,"id":"` + id + `","signal":"kill -9"}`))
	f.Add([]byte(`{"v":1,"id":"` + id + `","extra":1}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := decodeResult(b, id, 8, 4)
		if err != nil {
			return
		}
		if r.ID != id || len(r.Stdout) > 8 || len(r.Stderr) > 8 || len(r.Changed) > 4 || len(r.Deleted) > 4 || len(r.Skipped) > 4 ||
			(r.Signal != "" && !signalRe.MatchString(r.Signal)) || len(r.Error) > 304 || r.DurationMS < 0 {
			t.Fatalf("accepted %+v", r)
		}
		for _, c := range r.Error {
			if c < 0x20 {
				t.Fatalf("control character in the error %q", r.Error)
			}
		}
	})
}
