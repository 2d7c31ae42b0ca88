package oauth

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"sync"
	"time"

	"github.com/zitadel/oidc/v3/pkg/oidc"

	"github.com/sandbox-broker/sandbox-broker/services/identity"
)

// Lifetimes of the authorization step. Requests live in memory only: a
// restart in the middle of a consent means starting it again.
const (
	requestTTL   = 10 * time.Minute // from /authorize to the code exchange
	codeTTL      = 2 * time.Minute  // from consent to the code exchange
	maxRequests  = 1000             // pending requests, all clients together
	maxAttempts  = 5                // wrong bearer tokens on one consent page
	consentIDLen = 16               // random bytes in a request ID
)

// authRequest is one authorization request, from /authorize through the
// consent page to the code exchange. It implements op.AuthRequest.
type authRequest struct {
	id          string
	clientID    string
	redirectURI string
	state       string
	nonce       string
	scopes      []string
	audience    string // the resource, the access tokens' aud
	challenge   *oidc.CodeChallenge
	created     time.Time
	csrf        string

	// Set when the consent is approved.
	done      bool
	principal identity.Principal
	authTime  time.Time
	attempts  int

	// Set when the code is issued and redeemed.
	codeHash   string
	codeIssued time.Time
	redeemed   bool
	grantID    string // the grant its exchange created, revoked on replay
}

func (a *authRequest) GetID() string                         { return a.id }
func (a *authRequest) GetACR() string                        { return "" }
func (a *authRequest) GetAMR() []string                      { return []string{"bearer"} }
func (a *authRequest) GetAudience() []string                 { return []string{a.audience} }
func (a *authRequest) GetAuthTime() time.Time                { return a.authTime }
func (a *authRequest) GetClientID() string                   { return a.clientID }
func (a *authRequest) GetCodeChallenge() *oidc.CodeChallenge { return a.challenge }
func (a *authRequest) GetNonce() string                      { return a.nonce }
func (a *authRequest) GetRedirectURI() string                { return a.redirectURI }
func (a *authRequest) GetResponseType() oidc.ResponseType    { return oidc.ResponseTypeCode }
func (a *authRequest) GetResponseMode() oidc.ResponseMode    { return oidc.ResponseModeQuery }
func (a *authRequest) GetScopes() []string                   { return a.scopes }
func (a *authRequest) GetState() string                      { return a.state }
func (a *authRequest) GetSubject() string                    { return a.principal.ID }
func (a *authRequest) Done() bool                            { return a.done }

// authRequests holds pending requests and redeemed codes (kept until the
// request expires, so a replayed code is recognised and its grant revoked).
type authRequests struct {
	now    func() time.Time
	mu     sync.Mutex
	byID   map[string]*authRequest
	byCode map[string]string // sha256(code) → request ID
}

func newAuthRequests(now func() time.Time) *authRequests {
	return &authRequests{now: now, byID: map[string]*authRequest{}, byCode: map[string]string{}}
}

var (
	errRequestUnknown = errors.New("oauth: unknown or expired authorization request")
	errTooManyPending = errors.New("oauth: too many pending authorization requests")
	errCodeReplayed   = errors.New("oauth: authorization code already used")
)

func codeKey(code string) string {
	h := sha256.Sum256([]byte(code))
	return hex.EncodeToString(h[:])
}

func (rs *authRequests) add(a *authRequest) error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if len(rs.byID) >= maxRequests {
		rs.sweepLocked()
		if len(rs.byID) >= maxRequests {
			return errTooManyPending
		}
	}
	rs.byID[a.id] = a
	return nil
}

// pending returns a copy of a live, not yet approved request.
func (rs *authRequests) pending(id string) (authRequest, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok || a.done || rs.now().Sub(a.created) > requestTTL {
		return authRequest{}, errRequestUnknown
	}
	return *a, nil
}

// get returns a copy of any live request (op reads it to issue the code).
func (rs *authRequests) get(id string) (*authRequest, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok || rs.now().Sub(a.created) > requestTTL {
		return nil, errRequestUnknown
	}
	c := *a
	return &c, nil
}

// failedAttempt counts a wrong bearer token; the request is dropped after
// maxAttempts so a consent page cannot be used to guess tokens.
func (rs *authRequests) failedAttempt(id string) (dropped bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok {
		return true
	}
	a.attempts++
	if a.attempts >= maxAttempts {
		delete(rs.byID, id)
		return true
	}
	return false
}

// approve marks a pending request done for p.
func (rs *authRequests) approve(id string, p identity.Principal) error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok || a.done || rs.now().Sub(a.created) > requestTTL {
		return errRequestUnknown
	}
	a.done, a.principal, a.authTime = true, p, rs.now()
	return nil
}

func (rs *authRequests) remove(id string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	delete(rs.byID, id)
}

// saveCode binds the issued code to an approved request.
func (rs *authRequests) saveCode(id, code string) error {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok || !a.done || a.codeHash != "" {
		return errRequestUnknown
	}
	a.codeHash, a.codeIssued = codeKey(code), rs.now()
	rs.byCode[a.codeHash] = id
	return nil
}

// byCodeValue returns a copy of the request a code was issued for. A code that
// was already redeemed returns errCodeReplayed and the grant it created.
func (rs *authRequests) byCodeValue(code string) (*authRequest, string, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[rs.byCode[codeKey(code)]]
	switch {
	case !ok:
		return nil, "", errRequestUnknown
	case a.redeemed:
		return nil, a.grantID, errCodeReplayed
	case rs.now().Sub(a.codeIssued) > codeTTL:
		return nil, "", errRequestUnknown
	}
	c := *a
	return &c, "", nil
}

// redeem marks the code of request id used, atomically: of two racing
// exchanges only one gets past it.
func (rs *authRequests) redeem(id string) (replayedGrant string, err error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	a, ok := rs.byID[id]
	if !ok {
		return "", errRequestUnknown
	}
	if a.redeemed {
		return a.grantID, errCodeReplayed
	}
	a.redeemed = true
	return "", nil
}

// setGrant records the grant created by redeeming request id.
func (rs *authRequests) setGrant(id, grantID string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if a, ok := rs.byID[id]; ok {
		a.grantID = grantID
	}
}

func (rs *authRequests) sweep() {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.sweepLocked()
}

func (rs *authRequests) sweepLocked() {
	for id, a := range rs.byID {
		if rs.now().Sub(a.created) > requestTTL {
			delete(rs.byID, id)
			if a.codeHash != "" {
				delete(rs.byCode, a.codeHash)
			}
		}
	}
}
