package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"time"

	"github.com/sandbox-broker/sandbox-broker/audit"
	"github.com/sandbox-broker/sandbox-broker/services/brokererr"
	"github.com/sandbox-broker/sandbox-broker/services/files"
)

// uploadTool names signed uploads in the audit log (like "oauth.token",
// not a tool a client can call).
const uploadTool = "files.upload"

// auditUpload is files.UploadAudit: a signed upload, like a tool call,
// writes an intent row before anything is stored (no row, no upload) and
// an outcome row after. The principal is that of the session the
// workspace belongs to; a workspace no session owns takes no upload.
// Params never hold the signature, only its hash as in the logs.
func (b *Broker) auditUpload(ctx context.Context, u files.Upload, sigHash string) (func(files.UploadResult, error), error) {
	if b.sandboxes == nil {
		return nil, brokererr.New(brokererr.SandboxNotFound, "no sessions")
	}
	principal, session, err := b.sandboxes.Owner(ctx, u.WorkspaceID)
	if err != nil {
		return nil, err
	}
	var rnd [8]byte
	_, _ = rand.Read(rnd[:])
	id := "upload-" + hex.EncodeToString(rnd[:])
	intent, _ := json.Marshal(map[string]any{"session_id": session, "path": u.Path, "max_bytes": u.MaxBytes,
		"overwrite": u.Overwrite, "kid": u.KID, "sig_hash": sigHash})
	if _, err := b.audit.Append(ctx, audit.Record{CallID: id, Phase: audit.PhaseIntent, Principal: principal, Tool: uploadTool, Params: intent}); err != nil {
		b.log.Error().Str("call_id", id).Str("tool", uploadTool).Msg("audit_intent_failed")
		return nil, brokererr.Wrap(err, brokererr.Unavailable, "audit log unavailable")
	}
	start := time.Now()
	return func(res files.UploadResult, err error) {
		rec := audit.Record{CallID: id, Phase: audit.PhaseOutcome, Principal: principal, Tool: uploadTool,
			Outcome: audit.OutcomeSuccess, DurationMS: time.Since(start).Milliseconds()}
		if err != nil {
			rec.Outcome, rec.ErrorCode = audit.OutcomeFailure, string(brokererr.CodeOf(err))
		} else {
			rec.Params, _ = json.Marshal(map[string]any{"size": res.Size, "sha256": res.SHA256, "replaced": res.Replaced})
		}
		// The row outlives a client that hung up.
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, err := b.audit.Append(actx, rec); err != nil {
			b.log.Error().Str("call_id", id).Str("tool", uploadTool).Msg("audit_outcome_failed")
		}
	}, nil
}
