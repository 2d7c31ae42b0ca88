package process

import (
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/sandbox-broker/sandbox-broker/services/agent"
	"github.com/sandbox-broker/sandbox-broker/services/rootfs"
	"github.com/sandbox-broker/sandbox-broker/services/runnerfs"
	"github.com/sandbox-broker/sandbox-broker/services/sandbox"
)

// runner is what a sandbox is made from: a runner image's exported file
// system (services/runnerfs), mounted read-only as the sandbox's root, or
// the host's /usr when there is none. A session has one sandbox per
// runner, as the Docker backend has one container per image.
type runner struct {
	lang string           // the agent's default language (python starts the zygote)
	fs   *runnerfs.Runner // the verified tree; nil: the host's /usr
}

// hostSource is list_runners' word for languages run on host interpreters.
const hostSource = "host /usr: no runner file systems were found; build them with make runners"

// Layout is the mount points a runner file system needs (see bwrapArgs);
// `sandbox-broker runners seal` creates them.
func Layout() runnerfs.Layout {
	files := []string{AgentPath}
	for name := range etcFiles {
		files = append(files, "/etc/"+name)
	}
	sort.Strings(files)
	return runnerfs.Layout{
		Dirs:     []string{"/proc", "/dev", "/tmp", WorkspacePath, agent.SocketDir},
		Files:    files,
		Symlinks: map[string]string{DataAlias: WorkspacePath},
	}
}

// loadRunners verifies the runner file systems in Options.RunnersDir (one
// per language, each its own sandbox), or, when there are none, finds the
// host's interpreters, which then share one sandbox.
func (b *Backend) loadRunners() error {
	list, err := runnerfs.Open(b.o.RunnersDir, Layout())
	if err != nil {
		return err
	}
	b.runners = map[string]*runner{}
	for i, r := range list {
		if len(b.o.Languages) > 0 && !slices.Contains(b.o.Languages, r.Language) {
			continue
		}
		b.runners[r.Language] = &runner{lang: r.Language, fs: &list[i]}
	}
	if len(b.runners) > 0 {
		b.checkRunnersPrivate()
		return nil
	}
	host := &runner{lang: agent.LangBash}
	for _, lang := range b.hostLanguages() {
		b.runners[lang] = host
	}
	if _, ok := b.runners[agent.LangPython]; ok {
		host.lang = agent.LangPython
	}
	b.log.Warn().Msg("runner_rootfs_missing_using_host_interpreters")
	return nil
}

// checkRunnersPrivate warns when sandboxes can read where the runner file
// systems lie: bind sources show in /proc/self/mountinfo relative to their
// filesystem, which hides nothing unless the runners dir is inside
// SANDBOX_ROOT (on its overlay) or the root of a filesystem of its own.
func (b *Backend) checkRunnersPrivate() {
	dir, err1 := filepath.EvalSymlinks(b.o.RunnersDir) // what the binds resolve
	root, err2 := filepath.EvalSymlinks(b.o.Root)
	if err1 == nil && err2 == nil && strings.HasPrefix(dir, root+string(filepath.Separator)) {
		return
	}
	if res, err := rootfs.Ensure(b.o.RunnersDir, false); err == nil && res.Private {
		return
	}
	b.log.Warn().Msg("runner_rootfs_path_visible_to_sandboxes")
}

// hostLanguages lists the languages whose interpreter the host has under
// /usr (PATH inside is /usr/local/bin:/usr/bin).
func (b *Backend) hostLanguages() []string {
	var out []string
	for _, lang := range agent.RunLanguages {
		bin, ok := interpreters[lang]
		if !ok || len(b.o.Languages) > 0 && !slices.Contains(b.o.Languages, lang) {
			continue
		}
		for _, dir := range []string{"/usr/local/bin", "/usr/bin"} {
			p := filepath.Join(dir, bin)
			if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
				out = append(out, lang)
				break
			}
		}
	}
	return out
}

// interpreters lists, per run_code language (agent.RunLanguages), the
// interpreter that must exist under the host's /usr for the language to
// be offered without runner file systems.
var interpreters = map[string]string{
	agent.LangPython:     "python3",
	agent.LangBash:       "bash",
	agent.LangJavaScript: "node",
	agent.LangTypeScript: "tsx",
}

// sandboxRunners lists each distinct runner once.
func (b *Backend) sandboxRunners() []*runner {
	var out []*runner
	for _, lang := range slices.Sorted(maps.Keys(b.runners)) {
		if r := b.runners[lang]; !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	return out
}

// listRunners is Runners' answer: the image behind each language and the
// file system it runs on.
func (b *Backend) listRunners() []sandbox.Runner {
	out := make([]sandbox.Runner, 0, len(b.runners))
	for lang, r := range b.runners {
		if r.fs == nil {
			out = append(out, sandbox.Runner{Language: lang, Image: "process:" + interpreters[lang], Source: hostSource})
			continue
		}
		out = append(out, sandbox.Runner{Language: lang, Image: r.fs.Image, Source: "rootfs " + r.fs.Short()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Language < out[j].Language })
	return out
}

// jobRunner is the runner a job of lang runs in: lang's, or for "" the
// first of agent.JobLanguageOrder there is.
func (b *Backend) jobRunner(lang string) (*runner, error) {
	if lang == "" {
		for _, l := range agent.JobLanguageOrder {
			if r, ok := b.runners[l]; ok {
				return r, nil
			}
		}
	}
	return b.runnerFor(lang)
}

func (b *Backend) runnerFor(lang string) (*runner, error) {
	if r, ok := b.runners[lang]; ok {
		return r, nil
	}
	return nil, agent.UnknownLanguage(lang, maps.Keys(b.runners))
}
