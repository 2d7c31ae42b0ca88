package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"time"
)

// A cell's round trip with the kernel (kernel.py): one request line, then
// its outputs one per line until "done".

// readLines feeds k.lines from the kernel's socket; a line over
// maxKernelLine is discarded and noted on k.skip.
func (k *kernel) readLines(r io.ReadCloser) {
	defer close(k.lines)
	defer r.Close()
	br := bufio.NewReaderSize(r, 64<<10)
	for {
		line, err := readLine(br, maxKernelLine)
		if err == nil {
			select {
			case k.lines <- line:
			case <-k.gone:
				return
			}
			continue
		}
		var tooLong lineTooLongError
		if !errors.As(err, &tooLong) {
			return
		}
		select {
		case k.skip <- struct{}{}:
		default:
		}
		if discardLine(br) != nil {
			return
		}
	}
}

// discardLine skips the rest of the current line.
func discardLine(br *bufio.Reader) error {
	for {
		_, err := br.ReadSlice('\n')
		if !errors.Is(err, bufio.ErrBufferFull) {
			return err
		}
	}
}

// kernelMsg is one line from the kernel (see kernel.py).
type kernelMsg struct {
	T              string            `json:"t"`
	Name           string            `json:"name"`
	Text           string            `json:"text"`
	Kind           string            `json:"kind"`
	Data           map[string]string `json:"data"`
	EName          string            `json:"ename"`
	EValue         string            `json:"evalue"`
	Traceback      string            `json:"traceback"`
	Wait           bool              `json:"wait"`
	Status         string            `json:"status"`
	ExecutionCount int               `json:"execution_count"`
}

// cell accumulates a cell's outputs within the caps, with Jupyter's
// clear_output semantics (wait: clear when the next output arrives).
type cell struct {
	limit          int
	stdout, stderr []byte
	truncated      bool
	displays       displays
	exception      *Exception
	clearPending   bool
}

func (c *cell) clearIfPending() {
	if c.clearPending {
		c.clearPending = false
		c.stdout, c.stderr, c.truncated, c.exception = nil, nil, false, nil
		c.displays.reset()
	}
}

func (c *cell) write(stream *[]byte, text string) {
	keep := min(len(text), c.limit-len(*stream))
	if keep < len(text) {
		c.truncated = true
	}
	if keep > 0 {
		*stream = append(*stream, text[:keep]...)
	}
}

// apply adds one kernel message; it reports the final one.
func (c *cell) apply(m kernelMsg) (done bool) {
	if m.T != "done" && m.T != "clear" {
		c.clearIfPending()
	}
	switch m.T {
	case "stream":
		if m.Name == "stderr" {
			c.write(&c.stderr, m.Text)
		} else {
			c.write(&c.stdout, m.Text)
		}
	case "display": // update_display_data too: shown again, not replaced
		kind := DisplayData
		if m.Kind == DisplayResult {
			kind = DisplayResult
		}
		c.displays.add(Display{Kind: kind, Data: m.Data})
	case "truncated":
		c.truncated = true
	case "dropped":
		c.displays.dropped++
	case "error":
		c.exception = &Exception{Name: truncate(m.EName, 200), Value: truncate(m.EValue, 2000)}
		tb := m.Traceback
		if tb != "" && tb[len(tb)-1] != '\n' {
			tb += "\n"
		}
		c.write(&c.stderr, tb)
	case "clear":
		c.clearPending = true
		if !m.Wait {
			c.clearIfPending()
		}
	case "done":
		return true
	}
	return false
}

// execute sends code to the kernel and collects the cell's outputs until
// it is done, the kernel dies, or deadline passes.
func (k *kernel) execute(ctx context.Context, code string, deadline time.Time, limit int) Response {
	c := &cell{limit: limit}
	result := func(exit int, signal string, timedOut bool, ended string) Response {
		if c.stdout == nil {
			c.stdout = []byte{}
		}
		if c.stderr == nil {
			c.stderr = []byte{}
		}
		r := Response{ExitCode: exit, Signal: signal, Stdout: c.stdout, Stderr: c.stderr, Truncated: c.truncated,
			TimedOut: timedOut, Displays: c.displays.list, DisplaysDropped: c.displays.dropped, Exception: c.exception}
		if ended != "" {
			r.Kernel = &KernelStatus{Ended: ended}
		}
		return r
	}
	req, _ := json.Marshal(map[string]any{"code": code, "limit": limit})
	_ = k.conn.SetWriteDeadline(deadline)
	if _, err := k.conn.Write(append(req, '\n')); err != nil {
		return result(-1, "", false, "the kernel stopped reading ("+err.Error()+")")
	}
	// Died mid-cell: an OOM kill, os._exit, a crash. The broker reads the
	// signal against the cgroup's OOM counter. The kernel's socket closes
	// as it dies, so its end can be seen there first.
	died := func() Response {
		k.waitExit()
		if !k.kern.exited() {
			return result(-1, "", false, "the kernel closed its socket")
		}
		o := outcomeOf(k.kern.state, nil)
		return result(-1, o.signal, false, "the kernel "+k.kern.describe())
	}
	t := time.NewTimer(time.Until(deadline))
	defer t.Stop()
	for {
		select {
		case line, ok := <-k.lines:
			if !ok {
				return died()
			}
			var m kernelMsg
			if json.Unmarshal(line, &m) != nil {
				continue
			}
			if c.apply(m) {
				k.count = m.ExecutionCount
				exit := 0
				if m.Status != "ok" {
					exit = 1
				}
				return result(exit, "", false, "")
			}
		case <-k.skip:
			c.displays.dropped++
		case <-k.kern.done:
			return died()
		case <-t.C:
			return result(-1, "SIGKILL", true, "the cell timed out and the kernel was killed")
		case <-ctx.Done():
			return result(-1, "SIGKILL", false, "the agent is shutting down")
		}
	}
}
