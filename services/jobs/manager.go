// Package jobs runs long shell commands (execute_code and friends) as
// durable jobs: each job's output is an event log on disk, its status a row
// in state.db, so a reader can reconnect, poll by cursor, and still read
// a job after the broker restarts.
package jobs

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/rs/zerolog"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
	"github.com/sandbox-broker/sandbox-broker/services/statedb"
)

// Job statuses.
const (
	StatusRunning   = "running"
	StatusCompleted = "completed" // exited 0
	StatusFailed    = "failed"    // exited non-zero or by a signal
	StatusTimeout   = "timeout"
	StatusCancelled = "cancelled"
	StatusError     = "error" // could not start, or its end was lost
)

// IDPattern is an execution ID.
var IDPattern = regexp.MustCompile(`^exec_[0-9a-f]{32}$`)

// CancelGrace is how long a cancelled job has between SIGTERM and SIGKILL.
const CancelGrace = 5 * time.Second

// Server-side bounds on waits inside a tool call.
const (
	signalTimeout = 10 * time.Second
	stdinTimeout  = 30 * time.Second
)

// restartReason is recorded for jobs that were running when the broker stopped.
const restartReason = "the broker restarted while this job was running; output up to then is kept"

// Options configure a Manager.
type Options struct {
	DBPath        string // state.db
	Dir           string // <root>/jobs: one log directory per job
	MaxConcurrent int    // global live jobs
	MaxPerSession int    // live jobs per session
	LogMaxBytes   int64  // per job log
	Retention     time.Duration
	Now           func() time.Time
	Log           zerolog.Logger
	// Presence, with broker replicas on PostgreSQL, says which replica
	// runs each job: a job is lost only when its replica is gone. Nil
	// (one broker) means every job left running at Open is lost.
	Presence *statedb.Presence
}

// Manager owns every job.
type Manager struct {
	o          Options
	db         *sql.DB
	st         statements
	mu         sync.Mutex
	live       map[string]*job
	perSession map[string]int
	closing    bool // Close kills live jobs: they end as error, with the reason
	wg         sync.WaitGroup
}

// statements are the Manager's prepared statements for what each job and
// each status call does.
type statements struct {
	insert, end, status *sql.Stmt
	all                 statedb.Stmts
}

type job struct {
	id, principal, sessionKey string
	interactive               bool
	timeout                   time.Duration
	log                       *eventLog
	handle                    sandbox.Job // nil until started
	done                      chan struct{}
	mu                        sync.Mutex
	cancelled                 bool
	denials                   []EgressDenial // under mu
	deniedOther               int            // denials past maxDenials
}

// Info is a job's status as the tools report it.
type Info struct {
	ID          string `json:"execution_id"`
	SessionID   string `json:"session_id"`
	Command     string `json:"command"`
	Status      string `json:"status"`
	ExitCode    *int   `json:"exit_code,omitempty"`
	Signal      string `json:"signal,omitempty"`
	Error       string `json:"error,omitempty"`
	Interactive bool   `json:"interactive"`
	Network     string `json:"network"`
	StartedAt   string `json:"started_at"`
	EndedAt     string `json:"ended_at,omitempty"`
	LastSeq     int64  `json:"last_seq"`
	// EgressDenied lists the network requests the job's proxy refused.
	EgressDenied      []EgressDenial `json:"egress_denied,omitempty"`
	EgressDeniedOther int            `json:"egress_denied_other,omitempty"`
}

// schema is the job table in state.db. Append steps; never edit released
// ones.
var schema = statedb.Schema{Component: "jobs", Steps: []string{`CREATE TABLE IF NOT EXISTS jobs(
	id TEXT PRIMARY KEY,
	principal TEXT NOT NULL,
	session_id TEXT NOT NULL,
	command TEXT NOT NULL,
	status TEXT NOT NULL,
	exit_code INTEGER,
	signal TEXT NOT NULL DEFAULT '',
	error TEXT NOT NULL DEFAULT '',
	interactive INTEGER NOT NULL,
	network TEXT NOT NULL,
	started_at INTEGER NOT NULL,
	ended_at INTEGER);
CREATE INDEX IF NOT EXISTS jobs_by_principal ON jobs(principal, started_at);`,
	// 2: the replica that runs the job ('' for one broker).
	`ALTER TABLE jobs ADD COLUMN replica TEXT NOT NULL DEFAULT ''`}}

// Open opens the job table, marks jobs left running by a previous broker as
// errors (appending an error event to their logs), and prunes old jobs.
func Open(ctx context.Context, o Options) (*Manager, error) {
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.MaxConcurrent <= 0 {
		o.MaxConcurrent = 10
	}
	if o.MaxPerSession <= 0 {
		o.MaxPerSession = 5
	}
	if o.LogMaxBytes <= 0 {
		o.LogMaxBytes = 8 << 20
	}
	if o.Retention <= 0 {
		o.Retention = 7 * 24 * time.Hour
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	db, err := statedb.Open(ctx, o.DBPath, schema)
	if err != nil {
		return nil, fmt.Errorf("jobs: %w", err)
	}
	m := &Manager{o: o, db: db, live: map[string]*job{}, perSession: map[string]int{}}
	st := &m.st
	st.all, err = statedb.Prepare(ctx, db,
		statedb.Query{Dst: &st.insert, SQL: `INSERT INTO jobs(id, principal, session_id, command, status, interactive, network, started_at, replica) VALUES(?,?,?,?,?,?,?,?,?)`},
		statedb.Query{Dst: &st.end, SQL: `UPDATE jobs SET status = ?, exit_code = ?, signal = ?, error = ?, ended_at = ? WHERE id = ?`},
		statedb.Query{Dst: &st.status, SQL: `SELECT id, session_id, command, status, exit_code, signal, error, interactive, network, started_at, ended_at FROM jobs WHERE id = ? AND principal = ?`})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("jobs: %w", err)
	}
	if err := m.recover(ctx); err != nil {
		return nil, errors.Join(err, st.all.Close(), db.Close())
	}
	return m, nil
}

// Prune deletes ended jobs older than Retention with their logs (Open
// does it too; the broker calls this periodically). With replicas it also
// closes out the jobs of replicas that are gone.
func (m *Manager) Prune(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var err error
	if m.o.Presence != nil {
		err = m.recover(ctx)
	} else {
		err = m.prune(ctx, m.o.Now())
	}
	if err != nil {
		m.o.Log.Warn().Msg("job_prune_failed")
	}
}

// recover closes out jobs a broker (replica) that is gone left running,
// then prunes.
func (m *Manager) recover(ctx context.Context) error {
	ids, err := m.lostIDs(ctx)
	if err != nil {
		return err
	}
	now := m.o.Now()
	for _, id := range ids {
		if l, err := openLog(m.logDir(id), m.o.LogMaxBytes); err == nil {
			_, _ = l.append(Event{Type: EventError, Message: restartReason}, now)
			_ = l.close()
		}
		if _, err := m.db.ExecContext(ctx, `UPDATE jobs SET status = ?, error = ?, ended_at = ? WHERE id = ?`,
			StatusError, restartReason, now.UnixMilli(), id); err != nil {
			return err
		}
		m.o.Log.Warn().Str("execution_id", id).Msg("job_lost_on_restart")
	}
	return m.prune(ctx, now)
}

// lostIDs are the running jobs no live broker runs: not this one's, and
// (with replicas) not of a replica still alive. Without Presence, every
// job left running is lost.
func (m *Manager) lostIDs(ctx context.Context) ([]string, error) {
	rows, err := m.db.QueryContext(ctx, `SELECT id, replica FROM jobs WHERE status = ?`, StatusRunning)
	if err != nil {
		return nil, err
	}
	type row struct{ id, replica string }
	var running []row
	for rows.Next() {
		var r row
		if rows.Scan(&r.id, &r.replica) == nil && IDPattern.MatchString(r.id) {
			running = append(running, r)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var lost []string
	for _, r := range running {
		m.mu.Lock()
		_, live := m.live[r.id]
		m.mu.Unlock()
		if live {
			continue
		}
		if m.o.Presence != nil {
			if alive, err := m.o.Presence.Alive(ctx, r.replica); alive || err != nil {
				continue // running elsewhere, or unknown: not ours to close
			}
		}
		lost = append(lost, r.id)
	}
	return lost, nil
}

// ids runs query and returns the well-formed job IDs it selects (they
// name log directories).
func (m *Manager) ids(ctx context.Context, query string, args ...any) ([]string, error) {
	rows, err := m.db.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ids []string
	for rows.Next() {
		var id string
		if rows.Scan(&id) == nil && IDPattern.MatchString(id) {
			ids = append(ids, id)
		}
	}
	return ids, rows.Err()
}

func (m *Manager) prune(ctx context.Context, now time.Time) error {
	cut := now.Add(-m.o.Retention).UnixMilli()
	ids, err := m.ids(ctx, `SELECT id FROM jobs WHERE status != ? AND ended_at < ?`, StatusRunning, cut)
	if err != nil {
		return err
	}
	for _, id := range ids {
		_ = os.RemoveAll(m.logDir(id))
		if _, err := m.db.ExecContext(ctx, `DELETE FROM jobs WHERE id = ?`, id); err != nil {
			return err
		}
	}
	return nil
}

func (m *Manager) logDir(id string) string { return filepath.Join(m.o.Dir, id) }

// replica is the ID recorded with the jobs this broker runs.
func (m *Manager) replica() string {
	if m.o.Presence == nil {
		return ""
	}
	return m.o.Presence.Self()
}

// Ping checks the job store.
func (m *Manager) Ping(ctx context.Context) error { return m.db.PingContext(ctx) }

// Close kills live jobs (their status becomes error) and closes the store.
func (m *Manager) Close(ctx context.Context) error {
	m.mu.Lock()
	m.closing = true
	live := make([]*job, 0, len(m.live))
	for _, j := range m.live {
		live = append(live, j)
	}
	m.mu.Unlock()
	for _, j := range live {
		if j.handle != nil {
			_ = j.handle.Signal(ctx, syscall.SIGKILL)
		}
	}
	done := make(chan struct{})
	go func() { m.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
	}
	return errors.Join(m.st.all.Close(), m.db.Close())
}

// StartRequest is a validated job to start in one session.
type StartRequest struct {
	Principal  string
	SessionID  string // as the caller knows it
	SessionKey string // the session's workspace ID: the per-session limit's key
	Runner     sandbox.JobRunner
	Spec       sandbox.JobSpec // ID is assigned here
	Network    string          // the egress policy, as recorded
	// Egress, when set, builds the job's network path once the job exists,
	// so that the requests it refuses are recorded on the job.
	Egress EgressBuilder
	// OnEnd runs once the job has ended and its status is stored (unpin
	// the session, bill the time).
	OnEnd func(sandbox.JobExit)
	// Stdout, when set, turns the job's stdout into events (a coding
	// agent's JSON stream); it is called serially. Stderr stays raw.
	Stdout func(data []byte) []Event
	// Final, when set, runs once a started job has ended, before its
	// closing event; the events it returns are logged first (a task's
	// outcome). cancelled says cancel_execution ended it.
	Final func(x sandbox.JobExit, cancelled bool) []Event
	// ID, when set, is the execution's ID (from NewID), for a caller that
	// must name the job before it starts; "" assigns one.
	ID string
}

// NewID returns a new execution ID.
func NewID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "exec_" + hex.EncodeToString(b[:])
}

// limitError is a structured refusal, never a queue: the caller retries.
func limitError(format string, a ...any) error {
	return brokererr.New(brokererr.QuotaExceeded, format, a...).WithRetryAfter(time.Second)
}

// Start starts a job and returns its ID. Past a concurrency limit it fails
// at once with QUOTA_EXCEEDED.
func (m *Manager) Start(ctx context.Context, req StartRequest) (string, error) {
	refuse := func(err error) (string, error) {
		if req.OnEnd != nil {
			req.OnEnd(sandbox.JobExit{})
		}
		return "", err
	}
	m.mu.Lock()
	if m.closing {
		m.mu.Unlock()
		return refuse(brokererr.New(brokererr.Unavailable, "the broker is shutting down"))
	}
	if len(m.live) >= m.o.MaxConcurrent {
		m.mu.Unlock()
		return refuse(limitError("the broker runs its maximum of %d concurrent executions; wait for one to finish", m.o.MaxConcurrent))
	}
	if m.perSession[req.SessionKey] >= m.o.MaxPerSession {
		m.mu.Unlock()
		return refuse(limitError("this session runs its maximum of %d concurrent executions; wait for one to finish or cancel one", m.o.MaxPerSession))
	}
	id := req.ID
	if id == "" {
		id = NewID()
	} else if !IDPattern.MatchString(id) || m.live[id] != nil {
		m.mu.Unlock()
		return refuse(brokererr.New(brokererr.InternalError, "invalid execution id"))
	}
	j := &job{id: id, principal: req.Principal, sessionKey: req.SessionKey, interactive: req.Spec.Interactive,
		timeout: req.Spec.Timeout, done: make(chan struct{})}
	m.live[id] = j
	m.perSession[req.SessionKey]++
	m.mu.Unlock()

	fail := func(err error) (string, error) {
		m.forget(j)
		if j.log != nil {
			_ = j.log.close()
		}
		close(j.done)
		return refuse(err)
	}
	var err error
	if j.log, err = openLog(m.logDir(id), m.o.LogMaxBytes); err != nil {
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "job log unavailable"))
	}
	now := m.o.Now()
	if _, err := m.st.insert.ExecContext(ctx, id, req.Principal, req.SessionID, req.Spec.Command, StatusRunning, req.Spec.Interactive, req.Network, now.UnixMilli(), m.replica()); err != nil {
		_ = os.RemoveAll(m.logDir(id))
		return fail(brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable"))
	}
	spec := req.Spec
	spec.ID = id
	sink := func(stream string, data []byte) {
		evs := []Event{{Type: EventStdout, Data: toText(data)}}
		switch {
		case stream == sandbox.StreamStderr:
			evs[0].Type = EventStderr
		case req.Stdout != nil:
			evs = req.Stdout(data)
		}
		m.appendAll(j, evs)
	}
	// Ready goes first so a reader sees the job before any output.
	if _, err := j.log.append(Event{Type: EventReady, TimeoutSeconds: int(spec.Timeout / time.Second)}, now); err != nil {
		m.finish(j, sandbox.JobExit{Err: err}, req.OnEnd)
		return "", brokererr.Wrap(err, brokererr.Unavailable, "job log unavailable")
	}
	if req.Egress != nil {
		if spec.Egress, err = req.Egress(func(d EgressDenial) { m.deny(j, d) }); err != nil {
			m.finish(j, sandbox.JobExit{Err: err}, req.OnEnd)
			if brokererr.As(err) != nil {
				return "", err
			}
			return "", brokererr.Wrap(err, brokererr.Unavailable, "cannot give the execution a network path")
		}
	}
	h, err := req.Runner.StartJob(ctx, spec, sink)
	if err != nil {
		m.finish(j, sandbox.JobExit{Err: err}, req.OnEnd)
		var be *brokererr.Error
		if errors.As(err, &be) {
			return "", err
		}
		return "", brokererr.Wrap(err, brokererr.Unavailable, "the sandbox could not start the job")
	}
	j.mu.Lock()
	j.handle = h
	j.mu.Unlock()
	m.o.Log.Info().Str("execution_id", id).Str("session_id", req.SessionID).Bool("interactive", spec.Interactive).Msg("job_started")
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		<-h.Done()
		x := h.Exit()
		if req.Final != nil {
			j.mu.Lock()
			cancelled := j.cancelled
			j.mu.Unlock()
			m.appendAll(j, req.Final(x, cancelled))
		}
		m.finish(j, x, req.OnEnd)
	}()
	return id, nil
}

// appendAll logs evs in order.
func (m *Manager) appendAll(j *job, evs []Event) {
	for _, ev := range evs {
		ev.Data = toText([]byte(ev.Data))
		if _, err := j.log.append(ev, m.o.Now()); err != nil {
			m.o.Log.Warn().Str("execution_id", j.id).Msg("job_log_append_failed")
			return
		}
	}
}

// toText keeps output as valid UTF-8 text.
func toText(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	return strings.ToValidUTF8(string(b), "\uFFFD")
}

// finish writes the closing event and status, then frees the job's slot.
func (m *Manager) finish(j *job, x sandbox.JobExit, onEnd func(sandbox.JobExit)) {
	j.mu.Lock()
	cancelled := j.cancelled
	j.mu.Unlock()
	m.mu.Lock()
	closing := m.closing
	m.mu.Unlock()
	status, ev := StatusCompleted, Event{}
	code := x.ExitCode
	ms := x.Duration.Milliseconds()
	var be *brokererr.Error
	switch {
	case closing && !cancelled:
		status, ev = StatusError, Event{Type: EventError, Message: restartReason}
	case x.Err != nil && errors.As(x.Err, &be):
		// A structured cause (the workspace quota, say) is the model's to read.
		status, ev = StatusError, Event{Type: EventError, Message: be.Message + "; output up to then is kept"}
	case x.Err != nil:
		status, ev = StatusError, Event{Type: EventError, Message: "the job's sandbox stopped answering; output up to then is kept"}
	case cancelled:
		status, ev = StatusCancelled, Event{Type: EventCancelled, Code: &code, Signal: x.Signal, DurationMS: &ms}
	case x.TimedOut:
		status, ev = StatusTimeout, Event{Type: EventTimeout, TimeoutSeconds: int(j.timeout / time.Second), DurationMS: &ms}
	default:
		if code != 0 || x.Signal != "" {
			status = StatusFailed
		}
		ev = Event{Type: EventExit, Code: &code, Signal: x.Signal, DurationMS: &ms}
	}
	if x.Err != nil {
		m.o.Log.Warn().Str("execution_id", j.id).Str("cause", shortErr(x.Err)).Msg("job_lost")
	}
	now := m.o.Now()
	if _, err := j.log.append(ev, now); err != nil {
		m.o.Log.Warn().Str("execution_id", j.id).Msg("job_log_append_failed")
	}
	m.saveDenials(j)
	var exit any
	if status != StatusError {
		exit = code
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	_, err := m.st.end.ExecContext(ctx, status, exit, x.Signal, ev.Message, now.UnixMilli(), j.id)
	cancel()
	if err != nil {
		m.o.Log.Error().Str("execution_id", j.id).Msg("job_status_write_failed")
	}
	_ = j.log.close()
	m.forget(j)
	m.o.Log.Info().Str("execution_id", j.id).Str("status", status).Int64("duration_ms", ms).Msg("job_ended")
	if onEnd != nil {
		onEnd(x)
	}
	close(j.done)
}

// shortErr keeps a cause short for logs (the logger redacts it too).
func shortErr(err error) string {
	s := err.Error()
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}

func (m *Manager) forget(j *job) {
	m.mu.Lock()
	if m.live[j.id] == j {
		delete(m.live, j.id)
		if m.perSession[j.sessionKey]--; m.perSession[j.sessionKey] <= 0 {
			delete(m.perSession, j.sessionKey)
		}
	}
	m.mu.Unlock()
}

func notFound(id string) error {
	return brokererr.New(brokererr.SandboxNotFound, "no execution %q", id)
}

// Status returns the caller's job.
func (m *Manager) Status(ctx context.Context, principal, id string) (Info, error) {
	if !IDPattern.MatchString(id) {
		return Info{}, notFound(id)
	}
	row := m.st.status.QueryRowContext(ctx, id, principal)
	info, err := scanInfo(row.Scan)
	if errors.Is(err, sql.ErrNoRows) {
		return Info{}, notFound(id)
	}
	if err != nil {
		return Info{}, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
	}
	m.fillLastSeq(principal, &info)
	info.EgressDenied, info.EgressDeniedOther = m.denials(principal, id)
	return info, nil
}

// fillLastSeq sets info.LastSeq from the live log or, for an ended job,
// from the end of its log on disk.
func (m *Manager) fillLastSeq(principal string, info *Info) {
	if l := m.liveLog(principal, info.ID); l != nil {
		l.mu.Lock()
		info.LastSeq = l.next - 1
		l.mu.Unlock()
	} else if last, err := lastSeqOnDisk(m.logDir(info.ID)); err == nil {
		info.LastSeq = last
	}
}

func scanInfo(scan func(...any) error) (Info, error) {
	var i Info
	var exit sql.NullInt64
	var ended sql.NullInt64
	var started int64
	var interactive int
	if err := scan(&i.ID, &i.SessionID, &i.Command, &i.Status, &exit, &i.Signal, &i.Error, &interactive, &i.Network, &started, &ended); err != nil {
		return Info{}, err
	}
	if exit.Valid {
		c := int(exit.Int64)
		i.ExitCode = &c
	}
	i.Interactive = interactive != 0
	i.StartedAt = time.UnixMilli(started).UTC().Format(time.RFC3339Nano)
	if ended.Valid {
		i.EndedAt = time.UnixMilli(ended.Int64).UTC().Format(time.RFC3339Nano)
	}
	return i, nil
}

// List returns the caller's most recent jobs, newest first, optionally in
// one session.
func (m *Manager) List(ctx context.Context, principal, sessionID string, limit int) ([]Info, error) {
	q := `SELECT id, session_id, command, status, exit_code, signal, error, interactive, network, started_at, ended_at FROM jobs WHERE principal = ?`
	args := []any{principal}
	if sessionID != "" {
		q += ` AND session_id = ?`
		args = append(args, sessionID)
	}
	q += ` ORDER BY started_at DESC, id LIMIT ?`
	args = append(args, limit)
	rows, err := m.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
	}
	defer rows.Close()
	out := []Info{}
	for rows.Next() {
		i, err := scanInfo(rows.Scan)
		if err != nil {
			return nil, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
		}
		out = append(out, i)
	}
	if err := rows.Err(); err != nil {
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "job store unavailable")
	}
	for i := range out {
		m.fillLastSeq(principal, &out[i])
		out[i].EgressDenied, out[i].EgressDeniedOther = m.denials(principal, out[i].ID)
	}
	return out, nil
}

func (m *Manager) liveJob(principal, id string) *job {
	m.mu.Lock()
	defer m.mu.Unlock()
	if j, ok := m.live[id]; ok && j.principal == principal {
		return j
	}
	return nil
}

func (m *Manager) liveLog(principal, id string) *eventLog {
	if j := m.liveJob(principal, id); j != nil {
		return j.log
	}
	return nil
}

// ReadRequest is one get_execution_output call.
type ReadRequest struct {
	Since     int64
	Wait      time.Duration // 0: answer at once
	MaxEvents int
	MaxBytes  int
	// Gather, with Wait, keeps collecting for this long after the first
	// new event (or until MaxEvents, MaxBytes or the job's end), so that
	// output arriving line by line comes back in one answer.
	Gather time.Duration
}

// Output is what Read returns.
type Output struct {
	Page
	Status string
	// The job's refused network requests so far (all of them, not only
	// those of this page).
	EgressDenied      []EgressDenial
	EgressDeniedOther int
}

// Read returns the caller's job events after req.Since. With Wait it blocks
// until there is at least one (then gathers for req.Gather), the job ends,
// Wait passes or ctx ends.
func (m *Manager) Read(ctx context.Context, principal, id string, req ReadRequest) (Output, error) {
	out, err := m.read(ctx, principal, id, req)
	if err != nil {
		return Output{}, err
	}
	out.EgressDenied, out.EgressDeniedOther = m.denials(principal, id)
	return out, nil
}

func (m *Manager) read(ctx context.Context, principal, id string, req ReadRequest) (Output, error) {
	info, err := m.Status(ctx, principal, id)
	if err != nil {
		return Output{}, err
	}
	deadline := time.NewTimer(req.Wait)
	defer deadline.Stop()
	final := false // the read after gathering is the last
	for {
		j := m.liveJob(principal, id)
		var l *eventLog
		var changed <-chan struct{}
		if j != nil {
			l = j.log
			changed = l.wait()
		} else {
			l = &eventLog{dir: m.logDir(id), next: 1 << 62}
			if info.Status == StatusRunning {
				// Finished between the two lookups: reread the status.
				if info, err = m.Status(ctx, principal, id); err != nil {
					return Output{}, err
				}
			}
			if err := l.loadBounds(); err != nil {
				return Output{}, brokererr.Wrap(err, brokererr.Unavailable, "job log unavailable")
			}
		}
		p, err := l.read(req.Since, req.MaxEvents, req.MaxBytes)
		if err != nil {
			return Output{}, brokererr.Wrap(err, brokererr.Unavailable, "job log unavailable")
		}
		status := info.Status
		if j == nil && status == StatusRunning {
			status = StatusError
		}
		got := len(p.Events) > 0 || p.Dropped > 0
		if final || j == nil || req.Wait <= 0 || p.More || got && req.Gather <= 0 {
			return Output{Page: p, Status: status}, nil
		}
		if got { // once: the next read is final
			gather := time.NewTimer(req.Gather)
			defer gather.Stop()
			// The log is read once more after the window, the job's end or
			// a full page, not at every event.
			if !l.gatherWait(ctx, j.done, gather.C, deadline.C, p, req) {
				return Output{Page: p, Status: status}, nil
			}
			final = true
			continue
		}
		select {
		case <-changed:
		case <-j.done:
			if info, err = m.Status(ctx, principal, id); err != nil {
				return Output{}, err
			}
		case <-deadline.C:
			return Output{Page: p, Status: status}, nil
		case <-ctx.Done():
			return Output{Page: p, Status: status}, nil
		}
	}
}

// gatherWait waits, after a read that returned page p, until enough new
// events have been appended to fill the page, the job ends, or one of the
// timers fires. It reports whether the log is worth reading again: false
// when a timer fired or ctx ended with nothing new since p.
func (l *eventLog) gatherWait(ctx context.Context, done <-chan struct{}, gathered, deadline <-chan time.Time, p Page, req ReadRequest) bool {
	// Counted from the read of p: events appended since then are new,
	// even those appended before this call.
	next0, written0 := p.logNext, p.logWritten
	size := 0
	for _, e := range p.Events {
		size += len(e.Data)
	}
	for {
		changed := l.wait()
		next, written := l.counters()
		if int(next-next0)+len(p.Events) >= req.MaxEvents || int(written-written0)+size >= req.MaxBytes {
			return true
		}
		select {
		case <-changed:
		case <-done:
			return true
		case <-gathered:
			next, _ := l.counters()
			return next != next0
		case <-deadline:
			next, _ := l.counters()
			return next != next0
		case <-ctx.Done():
			return false
		}
	}
}

// loadBounds sets first from the files, for a log that is not open.
func (l *eventLog) loadBounds() error {
	segs, err := l.segments()
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if len(segs) > 0 {
		return scanSegment(filepath.Join(l.dir, segName(segs[0])), func(e Event) bool {
			l.first = e.Seq
			return false
		})
	}
	return nil
}

// SendStdin writes to a live interactive job's stdin.
func (m *Manager) SendStdin(ctx context.Context, principal, id string, data []byte, closeAfter bool) error {
	j, err := m.running(ctx, principal, id)
	if err != nil {
		return err
	}
	if !j.interactive {
		return brokererr.New(brokererr.Conflict, "execution %s was not started with interactive=true; its stdin is closed", id)
	}
	ctx, cancel := context.WithTimeout(ctx, stdinTimeout)
	defer cancel()
	if len(data) > 0 {
		if err := j.handle.WriteStdin(ctx, data); err != nil {
			var part *sandbox.PartialStdinError
			switch {
			case ctx.Err() != nil && errors.As(err, &part):
				// Part of it is in or on its way: sending it again would
				// repeat that part, so this is not retryable as is.
				e := brokererr.New(brokererr.SandboxTimeout, "execution %s did not read its stdin within %s: %d of %d bytes were accepted; send only the last %d",
					id, stdinTimeout, part.Written+part.Queued, part.Total, part.Total-part.Written-part.Queued)
				e.Retryable = false
				return e
			case ctx.Err() != nil:
				return brokererr.New(brokererr.SandboxTimeout, "execution %s did not read its stdin within %s; nothing was sent", id, stdinTimeout)
			}
			return brokererr.Wrap(err, brokererr.Conflict, "stdin of execution %s is closed", id)
		}
	}
	if closeAfter {
		if err := j.handle.CloseStdin(ctx); err != nil {
			return brokererr.Wrap(err, brokererr.Conflict, "stdin of execution %s is already closed", id)
		}
	}
	return nil
}

// running returns a live job of the caller's, or a structured error saying
// it has ended or does not exist.
func (m *Manager) running(ctx context.Context, principal, id string) (*job, error) {
	if j := m.liveJob(principal, id); j != nil {
		j.mu.Lock()
		h := j.handle
		j.mu.Unlock()
		if h != nil {
			return j, nil
		}
	}
	info, err := m.Status(ctx, principal, id)
	if err != nil {
		return nil, err
	}
	return nil, brokererr.New(brokererr.Conflict, "execution %s is not running (status %s)", id, info.Status)
}

// Cancel stops a live job: SIGTERM, then SIGKILL after CancelGrace, or
// SIGKILL at once with force. It waits (bounded by ctx) for the job to end.
func (m *Manager) Cancel(ctx context.Context, principal, id string, force bool) (Info, error) {
	j, err := m.running(ctx, principal, id)
	if err != nil {
		return Info{}, err
	}
	j.mu.Lock()
	j.cancelled = true
	j.mu.Unlock()
	sig := syscall.SIGTERM
	if force {
		sig = syscall.SIGKILL
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), signalTimeout)
	err = j.handle.Signal(sctx, sig)
	cancel()
	if err != nil {
		m.o.Log.Warn().Str("execution_id", id).Msg("job_signal_failed")
	}
	if !force {
		// The escalation must not depend on the caller staying connected.
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			grace := time.NewTimer(CancelGrace)
			defer grace.Stop()
			select {
			case <-j.done:
			case <-grace.C:
				kctx, cancel := context.WithTimeout(context.Background(), signalTimeout)
				_ = j.handle.Signal(kctx, syscall.SIGKILL)
				cancel()
			}
		}()
	}
	wait := time.NewTimer(CancelGrace + signalTimeout)
	defer wait.Stop()
	select {
	case <-j.done:
	case <-wait.C:
	case <-ctx.Done():
	}
	return m.Status(context.WithoutCancel(ctx), principal, id)
}

// Done returns a channel closed when the caller's live job ends, or nil
// when it is not live.
func (m *Manager) Done(principal, id string) <-chan struct{} {
	if j := m.liveJob(principal, id); j != nil {
		return j.done
	}
	return nil
}

// Changed returns a channel closed at the job's next event, or nil.
func (m *Manager) Changed(principal, id string) <-chan struct{} {
	if l := m.liveLog(principal, id); l != nil {
		return l.wait()
	}
	return nil
}
