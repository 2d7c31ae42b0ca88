package csbfake

import (
	"bytes"
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/coder/websocket"
	"github.com/vmihailenco/msgpack/v5"
)

// Pitcher error codes (codesandbox-api.md §5.1).
const (
	codeCritical           = 0
	codeFeatureUnavailable = 1
	codeNoAccess           = 2
	codeRawFS              = 102
	codeShellClosed        = 201
	codeShellNotFound      = 204
)

// agentConn is one client connection to a VM's agent.
type agentConn struct {
	c         *websocket.Conn
	sandboxID string
	ctx       context.Context
	srv       *Server
	// out carries the agent's messages, in order, to the sender, which
	// holds each back by the injected latency.
	out chan outgoing
}

type outgoing struct {
	due time.Time
	b   []byte
}

// sender writes queued messages once due, until the connection ends.
func (ac *agentConn) sender() {
	for {
		select {
		case <-ac.ctx.Done():
			return
		case m := <-ac.out:
			if d := time.Until(m.due); d > 0 {
				t := time.NewTimer(d)
				select {
				case <-t.C:
				case <-ac.ctx.Done():
					t.Stop()
					return
				}
			}
			ac.write(m.b)
		}
	}
}

func (ac *agentConn) write(b []byte) {
	ctx, cancel := context.WithTimeout(ac.ctx, 5*time.Second)
	defer cancel()
	_ = ac.c.Write(ctx, websocket.MessageBinary, b)
}

func (ac *agentConn) send(v any) {
	b, err := msgpack.Marshal(v)
	if err != nil {
		return
	}
	_, delay := ac.srv.latency()
	select {
	case ac.out <- outgoing{time.Now().Add(delay), b}:
	case <-ac.ctx.Done():
	}
}

func (ac *agentConn) notify(method string, params any) {
	ac.send(map[string]any{"method": method, "params": params})
}

// closeConns drops connections; hibernation announces itself first.
func closeConns(conns []*agentConn, hibernate bool) {
	for _, ac := range conns {
		if hibernate {
			if b, err := msgpack.Marshal(map[string]any{"method": "system/hibernate", "params": map[string]any{}}); err == nil {
				ac.write(b)
			}
		}
		_ = ac.c.CloseNow()
	}
}

// agentError is a rejected response.
type agentError struct {
	code  int
	msg   string
	errno int
}

func fsErr(errno int, what string) *agentError {
	return &agentError{code: codeRawFS, msg: what, errno: errno}
}

// servePitcher is GET /pitcher/{id}/?token=…; it returns the status it
// answered (101 once upgraded).
func (s *Server) servePitcher(w http.ResponseWriter, r *http.Request) int {
	rest := strings.TrimPrefix(r.URL.Path, "/pitcher/")
	id, ok := strings.CutSuffix(rest, "/")
	if !ok || id == "" || strings.Contains(id, "/") {
		writeError(w, http.StatusNotFound, "Not found")
		return http.StatusNotFound
	}
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		writeError(w, http.StatusMethodNotAllowed, "Method not allowed")
		return http.StatusMethodNotAllowed
	}
	token := r.URL.Query().Get("token")
	s.mu.Lock()
	sb := s.sandboxes[id]
	valid := sb != nil && !sb.deleted && sb.running && token != "" && slices.ContainsFunc(sb.tokens, func(t string) bool {
		return subtle.ConstantTimeCompare([]byte(t), []byte(token)) == 1
	})
	if !valid {
		s.mu.Unlock()
		http.Error(w, "invalid token", http.StatusUnauthorized)
		return http.StatusUnauthorized
	}
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		http.Error(w, "closing", http.StatusServiceUnavailable)
		return http.StatusServiceUnavailable
	}
	s.wsWG.Add(1)
	s.mu.Unlock()
	defer s.wsWG.Done()

	c, err := websocket.Accept(w, r, &websocket.AcceptOptions{InsecureSkipVerify: true})
	if err != nil {
		return http.StatusBadRequest
	}
	c.SetReadLimit(64 << 20)
	ctx, cancel := context.WithCancel(s.ctx)
	defer cancel()
	ac := &agentConn{c: c, sandboxID: id, ctx: ctx, srv: s, out: make(chan outgoing, 4096)}
	go ac.sender()
	s.mu.Lock()
	sb.conns[ac] = struct{}{}
	s.bumpLocked()
	s.mu.Unlock()
	defer func() {
		_ = c.CloseNow()
		s.mu.Lock()
		delete(sb.conns, ac)
		s.bumpLocked()
		s.mu.Unlock()
	}()
	s.agentLoop(ac, sb)
	return http.StatusSwitchingProtocols
}

type request struct {
	ID     *int               `msgpack:"id"`
	Method string             `msgpack:"method"`
	Params msgpack.RawMessage `msgpack:"params"`
}

// decodeStrict refuses unknown fields, like a schema-checked agent.
func decodeStrict(b []byte, v any) error {
	dec := msgpack.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields(true)
	return dec.Decode(v)
}

func (s *Server) agentLoop(ac *agentConn, sb *sandbox) {
	joined := false
	for {
		typ, data, err := ac.c.Read(ac.ctx)
		if err != nil {
			return
		}
		if typ == websocket.MessageText {
			// The SDK's heartbeat is an empty text frame; any message is a pong.
			s.mu.Lock()
			s.pings++
			silent := s.silentPings
			s.bumpLocked()
			s.mu.Unlock()
			if !silent {
				_ = ac.c.Write(ac.ctx, websocket.MessageText, nil)
			}
			continue
		}
		var req request
		if err := decodeStrict(data, &req); err != nil || req.ID == nil || req.Method == "" {
			_ = ac.c.Close(websocket.StatusPolicyViolation, "malformed message")
			return
		}
		var params map[string]any
		_ = msgpack.Unmarshal(req.Params, &params)
		s.mu.Lock()
		s.calls = append(s.calls, PitcherCall{SandboxID: sb.id, Method: req.Method, Params: params})
		s.mu.Unlock()
		var (
			result any
			aerr   *agentError
			after  func()
		)
		if !joined && req.Method != "client/join" {
			aerr = &agentError{code: codeNoAccess, msg: "client/join must be the first request"}
		} else {
			result, after, aerr = s.handle(ac, sb, req.Method, req.Params)
			if req.Method == "client/join" && aerr == nil {
				joined = true
			}
		}
		s.mu.Lock()
		withStatus := !s.noStatus
		s.bumpLocked()
		s.mu.Unlock()
		resp := map[string]any{"id": *req.ID, "method": req.Method}
		if aerr != nil {
			e := map[string]any{"code": aerr.code, "message": aerr.msg}
			if aerr.code == codeRawFS {
				e["data"] = map[string]any{"errno": aerr.errno}
			}
			resp["error"] = e
			if withStatus {
				resp["status"] = 1
			}
			ac.send(resp)
			continue
		}
		resp["result"] = result
		if withStatus {
			resp["status"] = 0
		}
		ac.send(resp)
		if after != nil {
			after()
		}
	}
}

type sizeParam struct {
	Cols int `msgpack:"cols"`
	Rows int `msgpack:"rows"`
}

// handle runs one agent method; after, if set, runs once the response
// is sent (shell output follows the shell/create response).
func (s *Server) handle(ac *agentConn, sb *sandbox, method string, raw msgpack.RawMessage) (any, func(), *agentError) {
	bad := func(err error) (any, func(), *agentError) {
		return nil, nil, &agentError{code: codeCritical, msg: "invalid params: " + err.Error()}
	}
	switch method {
	case "client/join":
		var p struct {
			ClientInfo struct {
				ProtocolVersion string `msgpack:"protocolVersion"`
				AppID           string `msgpack:"appId"`
			} `msgpack:"clientInfo"`
			AsyncProgress bool                       `msgpack:"asyncProgress"`
			Subscriptions map[string]map[string]bool `msgpack:"subscriptions"`
		}
		if err := decodeStrict(raw, &p); err != nil {
			return bad(err)
		}
		if p.ClientInfo.ProtocolVersion == "" {
			return bad(errors.New("clientInfo.protocolVersion is required"))
		}
		var after func()
		if p.AsyncProgress {
			after = func() { go s.runSetup(ac, sb) }
		}
		return map[string]any{
			"client": map[string]any{
				"clientId": "c_" + randHex(4), "username": "csb", "name": "csb", "avatarUrl": nil, "color": "#fff", "appId": p.ClientInfo.AppID,
			},
			"workspacePath": UserWorkspacePath, "version": PitcherVersion, "protocolVersion": PitcherVersion,
			"latestPitcherVersion": PitcherVersion, "capabilities": map[string]any{}, "permissions": map[string]any{},
			"isProtected": false, "reconnectToken": "rt_" + randHex(8),
		}, after, nil

	case "setup/get":
		if err := decodeStrict(raw, &struct{}{}); err != nil {
			return bad(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		return sb.progress(), nil, nil

	case "fs/writeFile":
		var p struct {
			Path      string `msgpack:"path"`
			Content   []byte `msgpack:"content"`
			Create    *bool  `msgpack:"create"`
			Overwrite *bool  `msgpack:"overwrite"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.Path == "" {
			return bad(fmt.Errorf("path and content are required: %v", err))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		full := sb.fs.abs(p.Path)
		exists := sb.fs.isFile(full)
		switch {
		case exists && p.Overwrite != nil && !*p.Overwrite:
			return nil, nil, fsErr(errEEXIST, "file exists")
		case !exists && p.Create != nil && !*p.Create:
			return nil, nil, fsErr(errENOENT, "no such file")
		}
		if e := sb.fs.write(full, p.Content, false); e != 0 {
			return nil, nil, fsErr(e, "cannot write "+full)
		}
		return map[string]any{}, nil, nil

	case "fs/readFile", "fs/stat", "fs/readdir":
		var p struct {
			Path string `msgpack:"path"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.Path == "" {
			return bad(fmt.Errorf("path is required: %v", err))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		full := sb.fs.abs(p.Path)
		switch method {
		case "fs/readFile":
			b, e := sb.fs.read(full)
			if e != 0 {
				return nil, nil, fsErr(e, "cannot read "+full)
			}
			return map[string]any{"content": b}, nil, nil
		case "fs/stat":
			st, e := sb.fs.stat(full)
			if e != 0 {
				return nil, nil, fsErr(e, "no such file or directory")
			}
			typ, ms := 0, st.mtime.UnixMilli()
			if st.dir {
				typ = 1
			}
			return map[string]any{"type": typ, "isSymlink": st.symlink, "size": st.size, "mtime": ms, "ctime": ms, "atime": ms}, nil, nil
		default:
			if sb.fs.isFile(full) {
				return nil, nil, fsErr(errENOTDIR, "not a directory")
			}
			ents, e := sb.fs.entries(full)
			if e != 0 {
				return nil, nil, fsErr(e, "no such file or directory")
			}
			entries := []map[string]any{}
			for _, de := range ents {
				t := 0
				if de.dir {
					t = 1
				}
				entries = append(entries, map[string]any{"name": de.name, "type": t, "isSymlink": de.symlink})
			}
			return map[string]any{"entries": entries}, nil, nil
		}

	case "fs/remove":
		// FSRemoveParams, pitcher-protocol/messages/fs.d.ts:195-203.
		var p struct {
			Path      string `msgpack:"path"`
			Recursive *bool  `msgpack:"recursive"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.Path == "" {
			return bad(fmt.Errorf("path is required: %v", err))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if e := sb.fs.remove(sb.fs.abs(p.Path), p.Recursive != nil && *p.Recursive); e != 0 {
			return nil, nil, fsErr(e, "cannot remove "+p.Path)
		}
		return map[string]any{}, nil, nil

	case "fs/mkdir":
		var p struct {
			Path      string `msgpack:"path"`
			Recursive bool   `msgpack:"recursive"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.Path == "" {
			return bad(fmt.Errorf("path is required: %v", err))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if e := sb.fs.mkdir(sb.fs.abs(p.Path), p.Recursive); e != 0 {
			return nil, nil, fsErr(e, "cannot create directory")
		}
		return map[string]any{}, nil, nil

	case "shell/create":
		var p struct {
			Command       *string    `msgpack:"command"`
			Cwd           *string    `msgpack:"cwd"`
			Size          *sizeParam `msgpack:"size"`
			Type          *string    `msgpack:"type"`
			IsSystemShell *bool      `msgpack:"isSystemShell"`
		}
		if err := decodeStrict(raw, &p); err != nil {
			return bad(err)
		}
		typ := "TERMINAL"
		if p.Type != nil {
			if *p.Type != "TERMINAL" && *p.Type != "COMMAND" {
				return bad(errors.New("type must be TERMINAL or COMMAND"))
			}
			typ = *p.Type
		}
		cmd, cwd := "", UserWorkspacePath
		if p.Command != nil {
			cmd = *p.Command
		}
		if p.Cwd != nil && *p.Cwd != "" {
			cwd = absFrom(UserWorkspacePath, *p.Cwd)
		}
		s.mu.Lock()
		sb.nshell++
		sh := &shell{id: "sh_" + strconv.Itoa(sb.nshell), name: cmd, typ: typ, command: cmd, status: "RUNNING", killed: make(chan struct{})}
		sb.shells[sh.id] = sh
		dto := sh.dto(true)
		s.mu.Unlock()
		if s.realShell { // the terminal exists once the shell is created
			run := s.startReal(ac, sb, sh, cwd)
			return dto, func() { go run() }, nil
		}
		return dto, func() { go s.runShell(ac, sb, sh, cwd) }, nil

	case "shell/in":
		// ShellIn, pitcher-protocol/messages/shell.d.ts:52-59: input goes
		// to the terminal; the result is null.
		var p struct {
			ShellID string     `msgpack:"shellId"`
			Input   *string    `msgpack:"input"`
			Size    *sizeParam `msgpack:"size"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.ShellID == "" || p.Input == nil || p.Size == nil {
			return bad(fmt.Errorf("shellId, input and size are required: %v", err))
		}
		s.mu.Lock()
		sh := sb.shells[p.ShellID]
		var tty *os.File
		if sh != nil {
			tty = sh.tty
		}
		s.mu.Unlock()
		switch {
		case sh == nil:
			return nil, nil, &agentError{code: codeShellNotFound, msg: "shell not found"}
		case tty == nil:
			return nil, nil, &agentError{code: codeShellClosed, msg: "shell is not running"}
		}
		if _, err := tty.WriteString(*p.Input); err != nil {
			return nil, nil, &agentError{code: codeShellClosed, msg: "shell is not running"}
		}
		return nil, nil, nil

	case "shell/list":
		if err := decodeStrict(raw, &struct{}{}); err != nil {
			return bad(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		shells := []map[string]any{}
		if sb.devPort > 0 {
			shells = append(shells, devShellDTO(sb, false))
		}
		for _, id := range sortedKeys(sb.shells) {
			shells = append(shells, sb.shells[id].dto(false))
		}
		return map[string]any{"shells": shells}, nil, nil

	case "shell/open", "shell/terminate":
		var p struct {
			ShellID string     `msgpack:"shellId"`
			Size    *sizeParam `msgpack:"size"`
		}
		if err := decodeStrict(raw, &p); err != nil || p.ShellID == "" {
			return bad(fmt.Errorf("shellId is required: %v", err))
		}
		if method == "shell/terminate" && p.Size != nil {
			return bad(errors.New(`unknown field "size"`))
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if sb.devPort > 0 && p.ShellID == devShellID {
			return devShellDTO(sb, method == "shell/open"), nil, nil
		}
		sh := sb.shells[p.ShellID]
		if sh == nil {
			return nil, nil, &agentError{code: codeShellNotFound, msg: "shell not found"}
		}
		if method == "shell/terminate" {
			sh.kill()
		}
		return sh.dto(method == "shell/open"), nil, nil

	case "task/list":
		if err := decodeStrict(raw, &struct{}{}); err != nil {
			return bad(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		tasks := map[string]any{}
		if sb.devPort > 0 {
			tasks["dev"] = map[string]any{
				"id": "dev", "name": "dev", "command": "npm run dev", "runAtStart": true,
				"preview": map[string]any{"port": sb.devPort}, "shell": devShellDTO(sb, false),
				"ports": []any{portDTO(sb.id, sb.devPort)},
			}
		}
		return map[string]any{"tasks": tasks, "setupTasks": []any{}, "validationErrors": []any{}}, nil, nil

	case "port/list":
		if err := decodeStrict(raw, &struct{}{}); err != nil {
			return bad(err)
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		list := []any{}
		if sb.devPort > 0 {
			list = append(list, portDTO(sb.id, sb.devPort))
		}
		return map[string]any{"list": list}, nil, nil
	}
	return nil, nil, &agentError{code: codeFeatureUnavailable, msg: "unknown method " + method}
}

func portDTO(id string, port int) map[string]any {
	return map[string]any{"port": port, "url": fmt.Sprintf("https://%s-%d.csb.app", id, port)}
}

const devShellID = "sh_dev"

func devShellDTO(sb *sandbox, withBuffer bool) map[string]any {
	d := map[string]any{"shellId": devShellID, "name": "dev", "status": "RUNNING", "shellType": "COMMAND", "startCommand": "npm run dev"}
	if withBuffer {
		buf := []string{
			"[CODESANDBOX] Running task dev\r\n",
			"\x1b[1m> dev\x1b[22m\r\n> vite --port " + strconv.Itoa(sb.devPort) + "\r\n\r\n",
			"  \x1b[32mready\x1b[39m on port " + strconv.Itoa(sb.devPort) + "\r\n",
		}
		d["buffer"] = append(buf, sb.devLog...)
	}
	return d
}

// shell is one shell/create'd shell.
type shell struct {
	id, name, typ, command string
	status                 string
	exit                   *int
	buffer                 []string
	killed                 chan struct{}
	once                   sync.Once
	tty                    *os.File // the terminal's input (real shell)
}

func (sh *shell) kill() {
	sh.once.Do(func() {
		sh.status = "KILLED"
		close(sh.killed)
	})
}

func (sh *shell) dto(withBuffer bool) map[string]any {
	d := map[string]any{"shellId": sh.id, "name": sh.name, "status": sh.status, "shellType": sh.typ}
	if sh.exit != nil {
		d["exitCode"] = *sh.exit
	}
	if sh.typ == "COMMAND" {
		d["startCommand"] = sh.command
	} else {
		d["ownerUsername"] = "csb"
		d["isSystemShell"] = true
	}
	if withBuffer {
		d["buffer"] = append([]string{}, sh.buffer...) // never nil: buffer is a string[]
	}
	return d
}

// runShell interprets the command and streams it like a terminal: a
// "[CODESANDBOX]" chunk, then output with ANSI codes and CRLF split at
// arbitrary points, then shell/exit.
func (s *Server) runShell(ac *agentConn, sb *sandbox, sh *shell, cwd string) {
	s.mu.Lock()
	out, code, wait := runCommand(sb.fs, sh.command, cwd)
	s.mu.Unlock()
	if wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-sh.killed:
			t.Stop()
			return
		case <-ac.ctx.Done():
			t.Stop()
			return
		}
	}
	term := "\x1b[?2004l" + strings.ReplaceAll(out, "\n", "\r\n")
	chunks := []string{"[CODESANDBOX] Running command\r\n"}
	for len(term) > 0 {
		n := min(len(term), 7+len(chunks)%5)
		for n < len(term) && !utf8.RuneStart(term[n]) {
			n++ // a terminal sends text, never half a character
		}
		chunks = append(chunks, term[:n])
		term = term[n:]
	}
	for _, c := range chunks {
		select {
		case <-sh.killed:
			return
		default:
		}
		s.mu.Lock()
		sh.buffer = append(sh.buffer, c)
		s.mu.Unlock()
		ac.notify("shell/out", map[string]any{"shellId": sh.id, "out": c})
	}
	s.mu.Lock()
	if sh.status == "KILLED" {
		s.mu.Unlock()
		return
	}
	sh.status, sh.exit = "FINISHED", &code
	s.bumpLocked()
	s.mu.Unlock()
	ac.notify("shell/exit", map[string]any{"shellId": sh.id, "shellType": sh.typ, "exitCode": code})
}
