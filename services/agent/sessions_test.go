package agent

import (
	"encoding/json"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestLiveSessionsSeesANewSession reads the host's real /proc: a child in
// a session of its own is listed while it runs and not once it is reaped.
func TestLiveSessionsSeesANewSession(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	sid := cmd.Process.Pid
	got, err := LiveSessions("/proc")
	if err != nil || !slices.Equal(got[sid], []int{sid}) {
		t.Fatalf("LiveSessions = %v, %v; want session %d to hold its leader", got, err, sid)
	}
	if _, self := got[os.Getpid()]; self {
		t.Fatalf("LiveSessions lists its caller: %v", got)
	}
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	got, err = LiveSessions("/proc")
	if _, ok := got[sid]; err != nil || ok {
		t.Fatalf("after the child ended: LiveSessions = %v, %v", got, err)
	}
}

// fakeProc writes a stat file for pid under root and, given threads as
// "state:tid", a task directory that lists them.
func fakeProc(t *testing.T, root, pid, state string, sid, threads int, tids ...string) {
	t.Helper()
	stat := func(dir, id, state string) {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		line := id + " (x) " + state + " 1 " + strconv.Itoa(sid) + " " + strconv.Itoa(sid) + " 0 0 0 0 0 0 0 2 0 0 0 20 0 " + strconv.Itoa(threads) + " 0 201 0 0\n"
		if err := os.WriteFile(filepath.Join(dir, "stat"), []byte(line), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	stat(filepath.Join(root, pid), pid, state)
	for _, tid := range tids {
		st, id, _ := strings.Cut(tid, ":")
		stat(filepath.Join(root, pid, "task", id), id, st)
	}
}

// TestLiveSessionsGVisorZombieLeader: gVisor's /proc has no thread listing
// for a zombie thread-group leader, whether its other threads run on
// (num_threads 2 below, as gVisor reports it) or the whole process has
// exited and waits to be reaped (num_threads 1). Only the first is live.
// Where threads are listed (Linux), they decide.
func TestLiveSessionsGVisorZombieLeader(t *testing.T) {
	root := t.TempDir()
	fakeProc(t, root, "27", "Z", 27, 2)                 // zombie leader, one thread still running
	fakeProc(t, root, "28", "Z", 28, 1)                 // exited, not reaped
	fakeProc(t, root, "29", "S", 29, 1)                 // threads unlisted, but not a zombie
	fakeProc(t, root, "30", "S", 27, 1, "S:30")         // in the session of 27
	fakeProc(t, root, "31", "Z", 31, 2, "Z:31", "S:32") // Linux: a zombie leader's thread listed
	fakeProc(t, root, "33", "Z", 31, 2, "Z:33", "Z:34") // every thread a zombie
	got, err := LiveSessions(root)
	want := Sessions{27: {27, 30}, 29: {29}, 31: {31}}
	if err != nil || !maps.EqualFunc(got, want, slices.Equal) {
		t.Fatalf("LiveSessions = %v, %v; want %v", got, err, want)
	}
}

func TestParseSessions(t *testing.T) {
	good, err := ParseSessions([]byte("[[1,1],[1,3],[7,7]]\n"))
	if want := (Sessions{1: {1, 3}, 7: {7}}); err != nil || !maps.EqualFunc(good, want, slices.Equal) {
		t.Fatalf("ParseSessions = %v, %v; want %v", good, err, want)
	}
	long := "[" + strings.Repeat("[1,1],", MaxSessionProcs) + "[1,1]]"
	for _, bad := range []string{
		"", "\n", "[]", "null", "{}", `{"1":[1]}`, "[[]]", "[[1]]", "[[1,2,3]]", "[null]", "[[1,null]]",
		"[[0,1]]", "[[1,0]]", "[[-1,1]]", "[[1,4194305]]", "[[1,1.0]]", "[[1,1e0]]", `[[1,"1"]]`,
		"[[1,1]] [[2,2]]", "[[1,1]]x", "[[1,1],[2,1]]", "[[1,1],[1,1]]",
		"[[1,99999999999999999999]]", long,
	} {
		if s, err := ParseSessions([]byte(bad)); err == nil {
			t.Errorf("ParseSessions(%.40q) = %v, want an error", bad, s)
		}
	}
}

// FuzzParseSessions: whatever the monitor sends, an accepted answer holds
// to the limits, and says the same once written back the monitor's way.
func FuzzParseSessions(f *testing.F) {
	for _, s := range []string{"[[1,1]]\n", "[[1,1],[1,3],[7,7]]", "[[1,1],[1,1]]", "[[4194304,4194304]]", "[[1,1]] ", "[ [1 ,2 ] ]"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseSessions(b)
		if err != nil {
			return
		}
		n := 0
		seen := map[int]bool{}
		for sid, procs := range s {
			if !validProcID(sid) || len(procs) == 0 {
				t.Fatalf("session %d: %v", sid, procs)
			}
			for _, p := range procs {
				if !validProcID(p) || seen[p] {
					t.Fatalf("process %d in %v", p, s)
				}
				seen[p] = true
				n++
			}
		}
		if n == 0 || n > MaxSessionProcs {
			t.Fatalf("%d processes accepted", n)
		}
		line, err := json.Marshal(s.pairs())
		if err != nil {
			t.Fatal(err)
		}
		again, err := ParseSessions(line)
		if err != nil || len(line)+1 > MaxSessionsAnswer {
			t.Fatalf("%s: %v", line, err)
		}
		norm := func(s Sessions) Sessions {
			for _, p := range s {
				slices.Sort(p)
			}
			return s
		}
		if !maps.EqualFunc(norm(s), norm(again), slices.Equal) {
			t.Fatalf("%v became %v", s, again)
		}
	})
}
