package agent

import (
	"bufio"
	"encoding/json"
	"errors"
	"io"
	"os"
	"slices"
	"strconv"
)

// SessionsCommand is the argument of `sandbox-broker agent` that runs
// ServeSessions on stdin and stdout.
const SessionsCommand = "sessions"

// LiveSessions returns the sorted session IDs of every live thread in
// procRoot, except the calling process's own. Under gVisor a sandbox's
// processes are not host processes, so the broker's stray check cannot read
// them from the host's /proc; it runs this in the sandbox instead, as a
// process the sandbox code cannot signal or trace, and reads the Sentry's
// /proc. Threads, not processes, as on the host: a process whose leader
// thread exited looks like a zombie while its other threads run on.
func LiveSessions(procRoot string) ([]int, error) {
	procs, _, err := listProcs(procRoot)
	if err != nil {
		return nil, err
	}
	self := os.Getpid()
	seen := map[int]bool{}
	for _, p := range procs {
		if p.pid == self {
			continue
		}
		dir := procRoot + "/" + strconv.Itoa(p.pid) + "/task"
		tids, err := readDirNames(dir)
		if err != nil {
			// gVisor lists no threads for a zombie leader, whether
			// other threads of it run on or not; its num_threads still
			// counts them beside the leader.
			if p.state != 'Z' && p.state != 'X' || p.threads > 1 {
				seen[p.sid] = true
			}
			continue
		}
		for _, tid := range tids {
			b, err := os.ReadFile(dir + "/" + tid + "/stat")
			if err != nil {
				continue
			}
			if st, ok := ParseProcStat(b); ok && st.Live() {
				seen[st.Session] = true
			}
		}
	}
	out := make([]int, 0, len(seen))
	for sid := range seen {
		out = append(out, sid)
	}
	slices.Sort(out)
	return out, nil
}

// ServeSessions answers each line read from r with LiveSessions of /proc
// as one line of JSON on w, until r ends.
func ServeSessions(r io.Reader, w io.Writer) error {
	in := bufio.NewReader(r)
	enc := json.NewEncoder(w)
	for {
		if _, err := in.ReadString('\n'); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		s, err := LiveSessions("/proc")
		if err != nil {
			return err
		}
		if err := enc.Encode(s); err != nil {
			return err
		}
	}
}

func readDirNames(dir string) ([]string, error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	return d.Readdirnames(-1)
}
