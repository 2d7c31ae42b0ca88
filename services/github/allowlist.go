// Package github commits to and reads from an operator-chosen allow-list of
// GitHub repositories, each with its own fine-grained personal access token.
// Everything a model sends is validated here before any request leaves.
package github

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"
	"strings"
)

// BaseBranches are the branches a repo may merge into.
var BaseBranches = []string{"main", "develop"}

// Limits of the allow-list file.
const (
	maxAllowListBytes = 1 << 20
	maxRepos          = 256
	maxGlobs          = 32
	maxGlobLen        = 200
	maxTokenFileBytes = 4 << 10
)

var (
	repoIDShape  = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)
	repoNameRE   = regexp.MustCompile(`^[A-Za-z0-9._-]{1,100}$`)
	envNameShape = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,127}$`)
	globChars    = regexp.MustCompile(`^[A-Za-z0-9._/*?\[\]-]+$`)
	// Fine-grained PATs are github_pat_<22>_<59>; the lengths are not
	// pinned so a format revision does not lock the broker out.
	fineGrainedPAT = regexp.MustCompile(`^github_pat_[A-Za-z0-9_]{30,240}$`)
	// legacyToken is the 40-hex shape classic tokens had before prefixes.
	legacyToken = regexp.MustCompile(`^[0-9a-fA-F]{40}$`)
)

// classicPrefixes are token kinds refused outright: they reach every repo
// their owner can, which an allow-list cannot contain.
var classicPrefixes = map[string]string{
	"ghp_": "a classic personal access token",
	"gho_": "an OAuth token",
	"ghu_": "a GitHub App user token",
	"ghs_": "a GitHub App installation token",
	"ghr_": "a refresh token",
}

// Repo is one allow-listed repository. Its token is loaded by LoadRepos or
// ResolveTokens and never printed: String and GoString leave it out.
type Repo struct {
	RepoID          string   `json:"repo_id"`
	Owner           string   `json:"owner"`
	Name            string   `json:"name"`
	AllowedBranches []string `json:"allowed_branches"`
	BaseBranch      string   `json:"base_branch"`
	TokenEnv        string   `json:"token_env"`

	token string
}

// String names the repo without its token.
func (r Repo) String() string { return r.RepoID + " (" + r.Owner + "/" + r.Name + ")" }

// GoString keeps %#v from printing the token.
func (r Repo) GoString() string { return "github.Repo{" + r.String() + "}" }

// HasToken reports whether a token was resolved for the repo.
func (r Repo) HasToken() bool { return r.token != "" }

// allowListKeys are the exact keys of one entry.
var allowListKeys = map[string]bool{
	"repo_id": true, "owner": true, "name": true, "allowed_branches": true, "base_branch": true, "token_env": true,
}

// ParseRepos strictly decodes and validates an allow-list document: a JSON
// array of entries with exactly the documented keys, each once, and no two
// entries with the same repo_id or owner/name. Tokens are not resolved.
func ParseRepos(data []byte) ([]Repo, error) {
	if len(data) > maxAllowListBytes {
		return nil, fmt.Errorf("allow-list is larger than %d bytes", maxAllowListBytes)
	}
	if err := checkAllowListKeys(data); err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var repos []Repo
	if err := dec.Decode(&repos); err != nil {
		return nil, fmt.Errorf("allow-list is not a valid JSON array of repos: %w", err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("allow-list has data after the JSON array")
	}
	if len(repos) == 0 {
		// A set GITHUB_REPOS_FILE that grants nothing is a mistake, not a
		// way to turn GitHub off (leave the variable unset for that).
		return nil, errors.New("allow-list lists no repositories")
	}
	if len(repos) > maxRepos {
		return nil, fmt.Errorf("allow-list has more than %d repos", maxRepos)
	}
	ids := map[string]bool{}
	names := map[string]string{}
	for i, r := range repos {
		if err := r.validate(); err != nil {
			return nil, fmt.Errorf("allow-list entry %d: %w", i, err)
		}
		if ids[r.RepoID] {
			return nil, fmt.Errorf("allow-list entry %d: repo_id %q is listed twice", i, r.RepoID)
		}
		ids[r.RepoID] = true
		// GitHub names are case-insensitive.
		full := strings.ToLower(r.Owner + "/" + r.Name)
		if prev, ok := names[full]; ok {
			return nil, fmt.Errorf("allow-list entry %d: %s/%s is already listed as %q", i, r.Owner, r.Name, prev)
		}
		names[full] = r.RepoID
	}
	return repos, nil
}

// checkAllowListKeys refuses what encoding/json would let through: keys
// that match a field only case-insensitively, and duplicate keys (the last
// would silently win).
func checkAllowListKeys(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("allow-list is not valid JSON: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '[' {
		return errors.New("allow-list must be a JSON array")
	}
	for i := 0; dec.More(); i++ {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("allow-list is not valid JSON: %w", err)
		}
		if d, ok := tok.(json.Delim); !ok || d != '{' {
			return fmt.Errorf("allow-list entry %d must be an object", i)
		}
		seen := map[string]bool{}
		for dec.More() {
			kt, err := dec.Token()
			if err != nil {
				return fmt.Errorf("allow-list is not valid JSON: %w", err)
			}
			key, _ := kt.(string)
			if !allowListKeys[key] {
				return fmt.Errorf("allow-list entry %d: unknown field %q", i, key)
			}
			if seen[key] {
				return fmt.Errorf("allow-list entry %d: field %q appears twice", i, key)
			}
			seen[key] = true
			var v json.RawMessage
			if err := dec.Decode(&v); err != nil {
				return fmt.Errorf("allow-list is not valid JSON: %w", err)
			}
		}
		if _, err := dec.Token(); err != nil { // closing '}'
			return fmt.Errorf("allow-list is not valid JSON: %w", err)
		}
	}
	return nil
}

func (r Repo) validate() error {
	if !repoIDShape.MatchString(r.RepoID) {
		return fmt.Errorf("repo_id must match %s", repoIDShape)
	}
	if !validOwner(r.Owner) {
		return fmt.Errorf("repo %s: owner %q is not a valid GitHub account name", r.RepoID, r.Owner)
	}
	if !repoNameRE.MatchString(r.Name) || r.Name == "." || r.Name == ".." {
		return fmt.Errorf("repo %s: name %q is not a valid GitHub repository name", r.RepoID, r.Name)
	}
	if !isBaseBranch(r.BaseBranch) {
		return fmt.Errorf("repo %s: base_branch must be one of %s", r.RepoID, strings.Join(BaseBranches, ", "))
	}
	if len(r.AllowedBranches) == 0 || len(r.AllowedBranches) > maxGlobs {
		return fmt.Errorf("repo %s: allowed_branches must list 1 to %d globs", r.RepoID, maxGlobs)
	}
	seen := map[string]bool{}
	for _, g := range r.AllowedBranches {
		if len(g) > maxGlobLen || !globChars.MatchString(g) {
			return fmt.Errorf("repo %s: allowed_branches glob %q must be 1 to %d of [A-Za-z0-9._/*?[]-]", r.RepoID, g, maxGlobLen)
		}
		if _, err := path.Match(g, ""); err != nil {
			return fmt.Errorf("repo %s: allowed_branches glob %q is malformed", r.RepoID, g)
		}
		if seen[g] {
			return fmt.Errorf("repo %s: allowed_branches glob %q is listed twice", r.RepoID, g)
		}
		seen[g] = true
	}
	if !envNameShape.MatchString(r.TokenEnv) {
		return fmt.Errorf("repo %s: token_env must be an environment variable name", r.RepoID)
	}
	return nil
}

// validOwner follows GitHub's account rules: 1-39 letters, digits and
// single inner hyphens.
func validOwner(s string) bool {
	if len(s) == 0 || len(s) > 39 || s[0] == '-' || s[len(s)-1] == '-' || strings.Contains(s, "--") {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
			return false
		}
	}
	return true
}

func isBaseBranch(b string) bool {
	for _, v := range BaseBranches {
		if b == v {
			return true
		}
	}
	return false
}

// LoadRepos reads the allow-list at file and resolves every token with
// lookupEnv (os.LookupEnv in production).
func LoadRepos(file string, lookupEnv func(string) (string, bool)) ([]Repo, error) {
	data, err := readCapped(file, maxAllowListBytes)
	if err != nil {
		return nil, fmt.Errorf("read GITHUB_REPOS_FILE: %w", err)
	}
	repos, err := ParseRepos(data)
	if err != nil {
		return nil, err
	}
	if err := ResolveTokens(repos, lookupEnv); err != nil {
		return nil, err
	}
	return repos, nil
}

// ResolveTokens loads each repo's token from the env variable token_env or,
// Docker-secret style, from the file named by token_env+"_FILE". Exactly one
// must be set, and the token must be a fine-grained PAT. Errors name the
// repo_id and the variable, never the value.
func ResolveTokens(repos []Repo, lookupEnv func(string) (string, bool)) error {
	for i := range repos {
		r := &repos[i]
		tok, source, err := readToken(r.TokenEnv, lookupEnv)
		if err != nil {
			return fmt.Errorf("repo %s: %w", r.RepoID, err)
		}
		if err := checkTokenShape(tok); err != nil {
			return fmt.Errorf("repo %s: the token in %s is %w", r.RepoID, source, err)
		}
		r.token = tok
	}
	return nil
}

func readToken(env string, lookupEnv func(string) (string, bool)) (tok, source string, err error) {
	val, inEnv := lookupEnv(env)
	file, inFile := lookupEnv(env + "_FILE")
	inEnv = inEnv && val != ""
	inFile = inFile && file != ""
	switch {
	case inEnv && inFile:
		return "", "", fmt.Errorf("both %s and %s_FILE are set; set one", env, env)
	case inEnv:
		return strings.TrimSpace(val), env, nil
	case inFile:
		b, err := readCapped(file, maxTokenFileBytes)
		if err != nil {
			// The path is operator config, not a secret, but stays out of
			// messages a client could see; this error only reaches startup.
			return "", "", fmt.Errorf("read the token file named by %s_FILE: %w", env, withoutPath(err))
		}
		return strings.TrimSpace(string(b)), env + "_FILE", nil
	}
	return "", "", fmt.Errorf("no token: set %s or %s_FILE", env, env)
}

// checkTokenShape accepts only fine-grained PATs. The returned error
// completes "the token in X is ...".
func checkTokenShape(tok string) error {
	if tok == "" {
		return errors.New("empty")
	}
	for p, kind := range classicPrefixes {
		if strings.HasPrefix(tok, p) {
			return fmt.Errorf("%s (%s…); only fine-grained personal access tokens (github_pat_…) are accepted", kind, p)
		}
	}
	if legacyToken.MatchString(tok) {
		return errors.New("a classic personal access token (the 40-hex legacy format); only fine-grained personal access tokens (github_pat_…) are accepted")
	}
	if !fineGrainedPAT.MatchString(tok) {
		return errors.New("not a fine-grained personal access token (github_pat_…); classic, OAuth and unknown token shapes are refused")
	}
	return nil
}

// readCapped reads a regular file of at most max bytes.
func readCapped(name string, max int64) ([]byte, error) {
	f, err := os.Open(name)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: not a regular file", os.ErrInvalid)
	}
	b, err := io.ReadAll(io.LimitReader(f, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > max {
		return nil, fmt.Errorf("%w: larger than %d bytes", os.ErrInvalid, max)
	}
	return b, nil
}

// withoutPath drops the file name from an os error.
func withoutPath(err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// Tokens lists the resolved token values, for the broker's redactor.
func Tokens(repos []Repo) []string {
	var out []string
	for _, r := range repos {
		if r.token != "" {
			out = append(out, r.token)
		}
	}
	return out
}
