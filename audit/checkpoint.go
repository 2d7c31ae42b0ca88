package audit

import (
	"bufio"
	"bytes"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/mod/sumdb/note"
	"golang.org/x/mod/sumdb/tlog"
	"golang.org/x/sys/unix"
)

// Origin is the first line of every checkpoint.
const Origin = KeyName

// checkpoint is one parsed entry of the checkpoint file.
type checkpoint struct {
	Size int64
	Root tlog.Hash
	Msg  []byte // the whole signed note
}

// checkpointText is the C2SP tlog-checkpoint body.
func checkpointText(size int64, root tlog.Hash) string {
	return fmt.Sprintf("%s\n%d\n%s\n", Origin, size, base64.StdEncoding.EncodeToString(root[:]))
}

func signCheckpoint(s note.Signer, size int64, root tlog.Hash) ([]byte, error) {
	return note.Sign(&note.Note{Text: checkpointText(size, root)}, s)
}

// parseCheckpointText parses the note text (after signature checking).
func parseCheckpointText(text string) (int64, tlog.Hash, error) {
	var h tlog.Hash
	lines := strings.SplitN(text, "\n", 4)
	if len(lines) < 4 || lines[0] != Origin {
		return 0, h, errors.New("bad origin")
	}
	size, err := strconv.ParseInt(lines[1], 10, 64)
	if err != nil || size < 0 || strconv.FormatInt(size, 10) != lines[1] {
		return 0, h, errors.New("bad size")
	}
	root, err := base64.StdEncoding.DecodeString(lines[2])
	if err != nil || len(root) != len(h) {
		return 0, h, errors.New("bad root")
	}
	copy(h[:], root)
	return size, h, nil
}

// splitNotes splits the checkpoint file into signed notes. Each note is
// written followed by one blank line, so a note is: text lines up to a blank
// line, then signature lines ("— ...") up to the next blank line or EOF.
func splitNotes(data []byte) [][]byte {
	var notes [][]byte
	var cur bytes.Buffer
	inSigs := false
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	flush := func() {
		if cur.Len() > 0 {
			notes = append(notes, bytes.Clone(cur.Bytes()))
		}
		cur.Reset()
		inSigs = false
	}
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "" && inSigs:
			flush()
		case line == "" && cur.Len() == 0:
			// stray blank line between notes
		case line == "":
			cur.WriteString("\n")
			inSigs = true
		default:
			cur.WriteString(line + "\n")
		}
	}
	flush()
	return notes
}

// readCheckpoints reads and verifies every checkpoint, stopping at the first
// bad one (reported in problem, numbered from 1) and returning those before
// it. A missing file is no checkpoints. err is only for I/O.
func readCheckpoints(path string, v note.Verifier) (cps []checkpoint, problem string, err error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, "", nil
	}
	if err != nil {
		return nil, "", fmt.Errorf("audit: read checkpoints: %w", err)
	}
	for i, msg := range splitNotes(data) {
		n, err := note.Open(msg, note.VerifierList(v))
		if err != nil {
			var inv *note.InvalidSignatureError
			var unk *note.UnknownVerifierError
			var unv *note.UnverifiedNoteError
			switch {
			case errors.As(err, &inv), errors.As(err, &unk), errors.As(err, &unv):
				return cps, fmt.Sprintf("checkpoint signature invalid (checkpoint %d)", i+1), nil
			default:
				return cps, fmt.Sprintf("checkpoint malformed (checkpoint %d)", i+1), nil
			}
		}
		size, root, err := parseCheckpointText(n.Text)
		if err != nil {
			return cps, fmt.Sprintf("checkpoint malformed (checkpoint %d: %v)", i+1, err), nil
		}
		if len(cps) > 0 && size < cps[len(cps)-1].Size {
			return cps, fmt.Sprintf("checkpoint sizes out of order (checkpoint %d)", i+1), nil
		}
		cps = append(cps, checkpoint{Size: size, Root: root, Msg: msg})
	}
	return cps, "", nil
}

// appendCheckpoint appends one signed note for a tree of treeSize rows
// plus a blank separator line and fsyncs, so a checkpoint never claims
// rows that are not yet durable: the caller only writes checkpoints for
// committed rows. A failed write (a full disk writes part of the note) is
// cut off again, so the file never holds half a note that the next one
// would be read as part of. Broker replicas on one host may share the
// file: writers take turns (flock), and a note is skipped when the file
// already ends with one for a tree as large, keeping sizes in order.
func appendCheckpoint(path string, treeSize int64, msg []byte) error {
	_, statErr := os.Stat(path)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("audit: open checkpoints: %w", err)
	}
	// The lock goes with the descriptor at Close.
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
	if last, ok := lastCheckpointSize(f); err == nil && ok && last >= treeSize {
		return f.Close()
	}
	var size int64
	var st os.FileInfo
	if err == nil {
		st, err = f.Stat()
	}
	if err == nil {
		size = st.Size()
		_, err = f.Write(append(bytes.Clone(msg), '\n'))
		if err == nil {
			err = f.Sync()
		}
		if err != nil {
			// Shrinking needs no space; if even this fails, the next
			// open reports the file as malformed rather than guessing.
			if terr := f.Truncate(size); terr == nil {
				_ = f.Sync()
			}
		}
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("audit: write checkpoint %s: %w", path, err)
	}
	if errors.Is(statErr, fs.ErrNotExist) {
		return syncDir(filepath.Dir(path))
	}
	return nil
}

// lastCheckpointSize is the tree size the file's last note states (its
// signature is checked by readers, not here: this only orders writers).
func lastCheckpointSize(f *os.File) (int64, bool) {
	data, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<40))
	if err != nil {
		return 0, false
	}
	notes := splitNotes(data)
	if len(notes) == 0 {
		return 0, false
	}
	text, _, _ := strings.Cut(string(notes[len(notes)-1]), "\n\n")
	size, _, err := parseCheckpointText(text + "\n")
	return size, err == nil
}
