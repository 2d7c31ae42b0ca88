package agent

import (
	"bufio"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
)

// SessionsCommand is the argument of `sandbox-broker agent` that runs
// ServeSessions on stdin and stdout.
const SessionsCommand = "sessions"

// Sessions maps each session of a sandbox to its processes (thread-group
// IDs) that have a live thread, all in the ID namespace of the /proc they
// were read from. It is what the broker's stray check (Strays) compares;
// the threads themselves are not listed: a process is in one session with
// all its threads, and gVisor cannot list the threads of a process whose
// leader thread exited while they run on.
type Sessions map[int][]int

// Limits of a session monitor's answer, which the broker parses as
// untrusted input (see ParseSessions). maxProcID is Linux's PID_MAX_LIMIT
// (gVisor's is lower); MaxSessionProcs is far above any sandbox's process
// limit.
const (
	maxProcID       = 1 << 22
	MaxSessionProcs = 1 << 14
	// MaxSessionsAnswer is the longest answer line, its newline included.
	MaxSessionsAnswer = len("[]\n") + MaxSessionProcs*len("[4194304,4194304],")
)

// LiveSessions reads procRoot for the sessions of every process with a
// live thread, except the calling process. Under gVisor a sandbox's
// processes are not host processes, so the broker's stray check cannot read
// them from the host's /proc; it runs this in the sandbox instead, as a
// process the sandbox code cannot signal or trace, and reads the Sentry's
// /proc. Threads, not processes, decide: a process whose leader thread
// exited looks like a zombie while its other threads run on.
func LiveSessions(procRoot string) (Sessions, error) {
	procs, _, err := listProcs(procRoot)
	if err != nil {
		return nil, err
	}
	self := os.Getpid()
	out := Sessions{}
	for _, p := range procs {
		if p.pid != self && liveProcess(procRoot, p) {
			out[p.sid] = append(out[p.sid], p.pid)
		}
	}
	return out, nil
}

// liveProcess reports whether some thread of p is live.
func liveProcess(procRoot string, p procInfo) bool {
	dir := procRoot + "/" + strconv.Itoa(p.pid) + "/task"
	tids, err := readDirNames(dir)
	if err != nil {
		// gVisor lists no threads for a zombie leader, whether other
		// threads of it run on or not; its num_threads still counts them
		// beside the leader.
		return p.state != 'Z' && p.state != 'X' || p.threads > 1
	}
	for _, tid := range tids {
		b, err := os.ReadFile(dir + "/" + tid + "/stat")
		if err != nil {
			continue
		}
		if st, ok := ParseProcStat(b); ok && st.Live() {
			return true
		}
	}
	return false
}

// pairs lists s as a session monitor's answer: [session, process] pairs,
// sorted.
func (s Sessions) pairs() [][2]int {
	out := make([][2]int, 0, len(s))
	for sid, pids := range s {
		for _, pid := range pids {
			out = append(out, [2]int{sid, pid})
		}
	}
	slices.SortFunc(out, func(a, b [2]int) int { return cmp.Or(cmp.Compare(a[0], b[0]), cmp.Compare(a[1], b[1])) })
	return out
}

// ParseSessions parses a session monitor's answer line: a JSON array of
// [session, process] pairs. The monitor runs inside the sandbox, so the
// answer is held to the format strictly: at most MaxSessionsAnswer bytes
// and MaxSessionProcs pairs, IDs in 1..maxProcID, each process listed
// once, and at least one process (the agent's).
func ParseSessions(line []byte) (Sessions, error) {
	if len(line) > MaxSessionsAnswer {
		return nil, errors.New("answer too long")
	}
	var pairs [][]int
	if err := json.Unmarshal(line, &pairs); err != nil {
		return nil, err
	}
	if len(pairs) == 0 {
		return nil, errors.New("no process listed")
	}
	if len(pairs) > MaxSessionProcs {
		return nil, errors.New("too many processes")
	}
	out := Sessions{}
	seen := make(map[int]bool, len(pairs))
	for _, p := range pairs {
		if len(p) != 2 || !validProcID(p[0]) || !validProcID(p[1]) {
			return nil, fmt.Errorf("bad pair %v", p)
		}
		if seen[p[1]] {
			return nil, fmt.Errorf("process %d listed twice", p[1])
		}
		seen[p[1]] = true
		out[p[0]] = append(out[p[0]], p[1])
	}
	return out, nil
}

func validProcID(id int) bool { return id >= 1 && id <= maxProcID }

// ServeSessions answers each line read from r with LiveSessions of /proc,
// as one line on w, until r ends.
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
		if err := enc.Encode(s.pairs()); err != nil {
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
