package logging

import (
	"context"
	"log/slog"

	"github.com/rs/zerolog"
)

// Slog adapts a zerolog logger for libraries that log through slog (mcp-go's
// HTTP transport), so their lines share our format and redaction. Their
// free-text message goes in "detail" under a fixed snake_case event name.
func Slog(l zerolog.Logger) *slog.Logger {
	return slog.New(&slogHandler{l: l})
}

type slogHandler struct {
	l     zerolog.Logger
	attrs []slog.Attr
}

func (h *slogHandler) Enabled(_ context.Context, lvl slog.Level) bool {
	return h.l.GetLevel() <= zlevel(lvl)
}

func (h *slogHandler) Handle(_ context.Context, r slog.Record) error {
	ev := h.l.WithLevel(zlevel(r.Level)).Str("detail", r.Message)
	add := func(a slog.Attr) bool {
		ev = ev.Str(a.Key, a.Value.String())
		return true
	}
	for _, a := range h.attrs {
		add(a)
	}
	r.Attrs(add)
	ev.Msg("mcp_transport_log")
	return nil
}

func (h *slogHandler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &slogHandler{l: h.l, attrs: append(append([]slog.Attr{}, h.attrs...), attrs...)}
}

func (h *slogHandler) WithGroup(string) slog.Handler { return h }

func zlevel(l slog.Level) zerolog.Level {
	switch {
	case l >= slog.LevelError:
		return zerolog.ErrorLevel
	case l >= slog.LevelWarn:
		return zerolog.WarnLevel
	case l >= slog.LevelInfo:
		return zerolog.InfoLevel
	}
	return zerolog.DebugLevel
}
