package workspace

import (
	"net/http"
	"path"
	"strings"
)

// mimeByExt is deliberately fixed (not the host's mime.types) so that
// results do not depend on the machine.
var mimeByExt = map[string]string{
	".png":     "image/png",
	".jpg":     "image/jpeg",
	".jpeg":    "image/jpeg",
	".gif":     "image/gif",
	".webp":    "image/webp",
	".bmp":     "image/bmp",
	".ico":     "image/x-icon",
	".tif":     "image/tiff",
	".tiff":    "image/tiff",
	".svg":     "image/svg+xml",
	".pdf":     "application/pdf",
	".csv":     "text/csv; charset=utf-8",
	".tsv":     "text/tab-separated-values; charset=utf-8",
	".json":    "application/json",
	".jsonl":   "application/jsonl",
	".ndjson":  "application/x-ndjson",
	".geojson": "application/geo+json",
	".ipynb":   "application/x-ipynb+json",
	".txt":     "text/plain; charset=utf-8",
	".log":     "text/plain; charset=utf-8",
	".md":      "text/markdown; charset=utf-8",
	".html":    "text/html; charset=utf-8",
	".htm":     "text/html; charset=utf-8",
	".css":     "text/css; charset=utf-8",
	".js":      "text/javascript; charset=utf-8",
	".mjs":     "text/javascript; charset=utf-8",
	".ts":      "text/plain; charset=utf-8",
	".py":      "text/x-python; charset=utf-8",
	".go":      "text/plain; charset=utf-8",
	".sh":      "text/plain; charset=utf-8",
	".yaml":    "application/yaml",
	".yml":     "application/yaml",
	".toml":    "application/toml",
	".xml":     "application/xml",
	".xlsx":    "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet",
	".xls":     "application/vnd.ms-excel",
	".docx":    "application/vnd.openxmlformats-officedocument.wordprocessingml.document",
	".pptx":    "application/vnd.openxmlformats-officedocument.presentationml.presentation",
	".odt":     "application/vnd.oasis.opendocument.text",
	".ods":     "application/vnd.oasis.opendocument.spreadsheet",
	".zip":     "application/zip",
	".gz":      "application/gzip",
	".tgz":     "application/gzip",
	".tar":     "application/x-tar",
	".bz2":     "application/x-bzip2",
	".xz":      "application/x-xz",
	".7z":      "application/x-7z-compressed",
	".parquet": "application/vnd.apache.parquet",
	".sqlite":  "application/vnd.sqlite3",
	".db":      "application/octet-stream",
	".wasm":    "application/wasm",
	".mp3":     "audio/mpeg",
	".wav":     "audio/wav",
	".ogg":     "audio/ogg",
	".flac":    "audio/flac",
	".mp4":     "video/mp4",
	".webm":    "video/webm",
	".mov":     "video/quicktime",
	".woff":    "font/woff",
	".woff2":   "font/woff2",
	".ttf":     "font/ttf",
	".otf":     "font/otf",
	".bin":     "application/octet-stream",
}

// DetectMIME returns a Content-Type for a file called name whose first
// bytes are head: by extension (case-insensitive) first, then
// http.DetectContentType, and application/octet-stream for empty content.
// The type is advisory: the file server always adds
// X-Content-Type-Options: nosniff, Content-Disposition: attachment and
// Content-Security-Policy: sandbox, so an HTML or SVG type cannot script
// the origin.
func DetectMIME(name string, head []byte) string {
	if t, ok := mimeByExt[strings.ToLower(path.Ext(name))]; ok {
		return t
	}
	if len(head) == 0 {
		return "application/octet-stream"
	}
	return http.DetectContentType(head)
}
