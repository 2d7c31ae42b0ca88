package audit

import (
	"bufio"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"
)

// pageSink keeps the compiler from dropping the reads that fault pages in.
var pageSink byte

// dirtyPages counts the pages of path the kernel holds but has not written
// to disk yet (PG_dirty, read through /proc/self/pagemap and
// /proc/kpageflags): after an fsync of the file there are none. It needs
// root; CI must run it.
func dirtyPages(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil || st.Size() == 0 {
		t.Fatalf("%s: %v, size %d", path, err, st.Size())
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(st.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(data)
	pagemap, err := os.Open("/proc/self/pagemap")
	if err != nil {
		t.Fatal(err)
	}
	defer pagemap.Close()
	flags, err := os.Open("/proc/kpageflags")
	if err != nil {
		t.Fatal(err)
	}
	defer flags.Close()
	const pageSize, present, kpfDirty = 4096, 1 << 63, 1 << 4
	dirty, seen := 0, 0
	var b [8]byte
	for off := 0; off < len(data); off += pageSize {
		pageSink += data[off] // map the page cache's page here
		addr := uintptr(unsafe.Pointer(&data[off]))
		if _, err := pagemap.ReadAt(b[:], int64(addr/pageSize)*8); err != nil {
			t.Fatal(err)
		}
		e := binary.LittleEndian.Uint64(b[:])
		if e&present == 0 {
			continue
		}
		if _, err := flags.ReadAt(b[:], int64(e&(1<<55-1))*8); err != nil {
			t.Fatal(err)
		}
		seen++
		if binary.LittleEndian.Uint64(b[:])&kpfDirty != 0 {
			dirty++
		}
	}
	if seen == 0 {
		t.Fatalf("%s: no page of the file could be inspected", path)
	}
	return dirty
}

// requirePageFlags skips (fails in CI) where page flags cannot be read.
func requirePageFlags(t *testing.T) {
	t.Helper()
	f, err := os.Open("/proc/kpageflags")
	if err == nil {
		f.Close()
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("read /proc/kpageflags (the durability tests need root in CI): %v", err)
	}
	t.Skipf("cannot read /proc/kpageflags: %v", err)
}

func rowCount(t *testing.T, path string) int64 {
	t.Helper()
	var n int64
	if err := rawDB(t, path).QueryRow("SELECT count(*) FROM audit").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestAppendReturnsOnceDurable: an intent row's Append returns with the
// row on disk (nothing of the WAL left to write back); an outcome row's
// once it is committed (readers see it) but before its fsync, which the
// next intent row does, or the writer SyncDelay later.
func TestAppendReturnsOnceDurable(t *testing.T) {
	requirePageFlags(t)
	ctx := context.Background()
	f := newFixture(t)
	f.opts.SyncDelay = time.Hour
	l := f.open(t)
	defer l.Close()
	wal := f.opts.Path + "-wal"
	intent, outcome := testRecord(0), testRecord(1)

	if _, err := l.Append(ctx, intent); err != nil {
		t.Fatal(err)
	}
	if n := dirtyPages(t, wal); n != 0 {
		t.Fatalf("intent row returned with %d WAL pages not on disk", n)
	}
	if _, err := l.Append(ctx, outcome); err != nil {
		t.Fatal(err)
	}
	if n := rowCount(t, f.opts.Path); n != 2 {
		t.Fatalf("a reader sees %d rows after the outcome row returned, want 2", n)
	}
	// Any process's sync(2) flushes the page cache too, so one clean
	// look may be someone else's doing; five in a row are the writer's.
	for i := 0; dirtyPages(t, wal) == 0; i++ {
		if i == 4 {
			t.Fatal("outcome rows were synced at once: the check cannot tell a synced log from one that is not")
		}
		if _, err := l.Append(ctx, testRecord(3+2*i)); err != nil { // an outcome row (odd)
			t.Fatal(err)
		}
	}
	if _, err := l.Append(ctx, intent); err != nil {
		t.Fatal(err)
	}
	if n := dirtyPages(t, wal); n != 0 {
		t.Fatalf("the next intent row returned with %d WAL pages not on disk", n)
	}

	// The writer syncs an outcome row that nothing follows.
	g := newFixture(t)
	synced := make(chan error, 1)
	g.opts.SyncDelay, g.opts.syncDone = 10*time.Millisecond, synced
	l2 := g.open(t)
	defer l2.Close()
	if _, err := l2.Append(ctx, outcome); err != nil {
		t.Fatal(err)
	}
	if err := <-synced; err != nil {
		t.Fatalf("delayed sync: %v", err)
	}
	if n := dirtyPages(t, g.opts.Path+"-wal"); n != 0 {
		t.Fatalf("%d WAL pages not on disk after the delayed sync", n)
	}
}

// TestGroupCommitConcurrent: callers appending at once share batches (and
// their fsync); every caller gets the seq of its own row, rows are dense,
// checkpoints land on their usual sizes, and the log verifies.
func TestGroupCommitConcurrent(t *testing.T) {
	requirePageFlags(t)
	f := newFixture(t)
	f.opts.CheckpointEvery = 100
	f.opts.SyncDelay = time.Hour
	l := f.open(t)
	const callers, each = 8, 50
	got := make([][]int64, callers)
	var wg sync.WaitGroup
	for c := range callers {
		wg.Go(func() {
			for i := range each {
				r := Record{CallID: fmt.Sprintf("c%d-%d", c, i), Phase: PhaseIntent, Principal: "p", Tool: "t"}
				seq, err := l.Append(context.Background(), r)
				if err != nil {
					t.Errorf("Append: %v", err)
					return
				}
				got[c] = append(got[c], seq)
			}
		})
	}
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	if n := dirtyPages(t, f.opts.Path+"-wal"); n != 0 {
		t.Fatalf("%d WAL pages not on disk after every intent row returned", n)
	}
	l.sem <- struct{}{}
	batches := l.batches
	l.unlock()
	if batches >= callers*each {
		t.Errorf("%d batches for %d rows from %d callers at once: no commit was shared", batches, callers*each, callers)
	}
	db := rawDB(t, f.opts.Path)
	seen := map[int64]bool{}
	for c, seqs := range got {
		for i, seq := range seqs {
			var id string
			if err := db.QueryRow("SELECT call_id FROM audit WHERE seq = ?", seq).Scan(&id); err != nil || id != fmt.Sprintf("c%d-%d", c, i) || seen[seq] {
				t.Fatalf("caller %d row %d got seq %d, which holds %q (%v, seen before: %v)", c, i, seq, id, err, seen[seq])
			}
			seen[seq] = true
		}
	}
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if rep := f.verify(t); !rep.OK || rep.Rows != callers*each || rep.Checkpoints != callers*each/100 {
		t.Fatalf("Verify: %+v, want OK with %d rows and %d checkpoints", rep, callers*each, callers*each/100)
	}
	t.Logf("%d rows in %d batches", callers*each, batches)
}

// Environment of the appending helper process.
const envHelperRoot = "AUDIT_APPEND_HELPER_ROOT"

// TestAppendHelperProcess is not a real test: run by
// TestSIGKILLAfterAppendsReturn it appends intent rows from 8 goroutines
// and prints "seq call_id" as each Append returns, until it is killed.
func TestAppendHelperProcess(t *testing.T) {
	root := os.Getenv(envHelperRoot)
	if root == "" {
		t.Skip("helper process only")
	}
	keys, err := LoadKeys(KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	l, err := Open(context.Background(), Options{Path: filepath.Join(root, "audit.db"),
		CheckpointPath: filepath.Join(root, "audit.checkpoints"), Keys: keys, CheckpointEvery: 64})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := 0; ; i++ {
				id := fmt.Sprintf("g%d-%d", g, i)
				seq, err := l.Append(context.Background(), Record{CallID: id, Phase: PhaseIntent, Principal: "p", Tool: "t"})
				if err != nil {
					fmt.Fprintln(os.Stderr, err)
					os.Exit(1)
				}
				mu.Lock()
				fmt.Printf("%d %s\n", seq, id) // os.Stdout is unbuffered
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

// TestSIGKILLAfterAppendsReturn kills a process appending from 8
// goroutines at a random moment: every row whose Append had returned is
// in the log after the kill, and the log opens and verifies.
func TestSIGKILLAfterAppendsReturn(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, seed))
	root := t.TempDir()
	keys, err := LoadKeys(KeyConfig{Root: root})
	if err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestAppendHelperProcess$", "-test.count=1")
		cmd.Env = append(os.Environ(), envHelperRoot+"="+root)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		returned := map[int64]string{}
		target := 50 + rng.IntN(300)
		sc := bufio.NewScanner(out)
		for len(returned) < target && sc.Scan() {
			seqText, id, ok := strings.Cut(sc.Text(), " ")
			seq, err := strconv.ParseInt(seqText, 10, 64)
			if !ok || err != nil {
				continue // the test binary's own output
			}
			returned[seq] = id
		}
		_ = cmd.Process.Signal(syscall.SIGKILL)
		_ = cmd.Wait()
		if len(returned) < target {
			t.Fatalf("round %d: the helper stopped after %d rows", round, len(returned))
		}
		db := rawDB(t, filepath.Join(root, "audit.db"))
		for seq, want := range returned {
			var id string
			if err := db.QueryRow("SELECT call_id FROM audit WHERE seq = ?", seq).Scan(&id); err != nil || id != want {
				t.Fatalf("round %d: seq %d returned for %s, after the kill: %q %v", round, seq, want, id, err)
			}
		}
		db.Close()
		rep, err := Verify(context.Background(), VerifyOptions{Path: filepath.Join(root, "audit.db"),
			CheckpointPath: filepath.Join(root, "audit.checkpoints"), Keys: keys})
		if err != nil || !rep.OK {
			t.Fatalf("round %d: Verify after SIGKILL: %+v %v", round, rep, err)
		}
		t.Logf("round %d: %d rows had returned, %d in the log", round, len(returned), rep.Rows)
	}
}

// TestSyncFailureRefusesRows: when the WAL cannot be fsynced (here it was
// deleted under the log, so it cannot even be opened), the intent row
// waiting for that fsync is refused, every later row is refused without
// being written (a later fsync could not vouch for pages the failed one
// lost), and Ping reports it.
func TestSyncFailureRefusesRows(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	l := f.open(t)
	defer l.Close()
	fill(t, l, 2)
	if err := os.Remove(f.opts.Path + "-wal"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Append(ctx, testRecord(2)); err == nil {
		t.Fatal("an intent row was acknowledged although its fsync failed")
	}
	if err := l.Ping(ctx); err == nil {
		t.Fatal("Ping is healthy after a failed fsync")
	}
	l.sem <- struct{}{}
	last := l.lastSeq
	l.unlock()
	for i := range 3 {
		r := testRecord(3 + i)
		r.Phase = PhaseOutcome
		if _, err := l.Append(ctx, r); err == nil {
			t.Fatal("a row was acknowledged after a failed fsync")
		}
	}
	l.sem <- struct{}{}
	after := l.lastSeq
	l.unlock()
	if after != last {
		t.Fatalf("rows after the failed fsync were written: last seq %d, was %d", after, last)
	}
}
