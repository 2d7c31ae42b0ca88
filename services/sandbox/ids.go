package sandbox

import (
	"crypto/rand"
	"encoding/hex"
	"path"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
)

// NewID returns a backend's name for something it starts (a container,
// a sandbox's run directory, a socket): 64 random bits as 16 lowercase
// hex digits.
func NewID() string {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return hex.EncodeToString(b[:])
}

// ValidID reports whether s is an ID NewID could have made.
func ValidID(s string) bool {
	if len(s) != 16 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// CheckRef refuses a SessionRef a backend must not open: a workspace ID
// that is not a plain name (or is one the backends use for their own
// directories), or a Dir that is not a clean absolute path.
func CheckRef(ref SessionRef) error {
	if !validWorkspaceID(ref.WorkspaceID) {
		return brokererr.New(brokererr.InvalidInput, "invalid workspace id")
	}
	if ref.Dir == "" || !strings.HasPrefix(ref.Dir, "/") || path.Clean(ref.Dir) != ref.Dir {
		return brokererr.New(brokererr.InternalError, "workspace dir must be a clean absolute path")
	}
	return nil
}

func validWorkspaceID(s string) bool {
	if s == "" || len(s) > 64 || s == "pool" || s == "probe" {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}
