package docrun

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// blockTimeout bounds one block; a block that waits on the cluster for
// longer is a bug of the document or of the cluster.
const blockTimeout = 2 * time.Minute

// interruptGrace is how long a block that streams until Ctrl-C may take
// to end after its SIGINT.
const interruptGrace = 5 * time.Second

// TestDocsRun runs every sh block of README.md and docs/ against the
// cluster `make cluster` starts, page by page, as a reader would paste
// them: in the repository root, with the exports make cluster prints, and
// with what earlier blocks of the page exported or set. A block must exit
// 0 (or the status of its exit marker) and show the lines of the output
// block after it. Blocks marked not run are skipped with their reason.
//
// It needs the binaries in bin/ and the fixed ports of make cluster, so
// it runs only with PIVIRT_DOCS_RUN=1: `make docs-run` (CI runs it).
func TestDocsRun(t *testing.T) {
	if os.Getenv("PIVIRT_DOCS_RUN") == "" {
		t.Skip("set PIVIRT_DOCS_RUN=1 (make docs-run): it starts make cluster's agents on their fixed ports")
	}
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range []string{"pivirt-agent", "pvcli", "pitrust", "pivirtd-sim"} {
		if _, err := os.Stat(filepath.Join(root, "bin", b)); err != nil {
			t.Fatalf("bin/%s: %v: build first (make build; make docs-run does)", b, err)
		}
	}
	// make cluster's fixed ports must be free: the documents start from a
	// cluster of their own.
	for _, port := range []string{"8440", "8443", "8453", "8463"} {
		ln, err := net.Listen("tcp", "127.0.0.1:"+port)
		if err != nil {
			t.Fatalf("127.0.0.1:%s is taken (%v): stop make cluster's agents (make cluster-stop) or whatever holds it", port, err)
		}
		ln.Close()
	}
	untracked := untrackedFiles(t, root)
	t.Cleanup(func() { removeNewFiles(t, root, untracked) })
	work := workDir(t, root)
	out, err := clusterScript(t, work, "start")
	t.Cleanup(func() {
		if out, err := clusterScript(t, work, "stop"); err != nil {
			t.Errorf("make cluster-stop: %v\n%s", err, out)
		}
	})
	if err != nil {
		t.Fatalf("make cluster: %v\n%s", err, out)
	}
	env := clusterEnv(t, work, out)

	pages, err := Pages(root)
	if err != nil {
		t.Fatal(err)
	}
	// PIVIRT_DOCS_RUN_PAGES (a regular expression) picks pages while a
	// document is being written.
	only := regexp.MustCompile(os.Getenv("PIVIRT_DOCS_RUN_PAGES"))
	ran, skipped := 0, 0
	start := time.Now()
	for _, page := range pages {
		rel, _ := filepath.Rel(root, page)
		if !only.MatchString(rel) {
			continue
		}
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		blocks, err := Parse(rel, string(b))
		if err != nil {
			t.Fatal(err)
		}
		var run []Block // sh blocks to run and files to write, in order
		for _, bl := range blocks {
			switch {
			case bl.SaveAs != "":
				run = append(run, bl)
			case bl.Lang != "sh":
			case bl.NotRun != "":
				skipped++
			default:
				run = append(run, bl)
			}
		}
		if !slices.ContainsFunc(run, func(b Block) bool { return b.SaveAs == "" }) {
			continue
		}
		t.Run(rel, func(t *testing.T) {
			// Every page starts with the three agents up (a page may stop
			// one).
			if out, err := clusterScript(t, work, "start"); err != nil {
				t.Fatalf("make cluster before the page: %v\n%s", err, out)
			}
			state := filepath.Join(t.TempDir(), "state.sh")
			for _, bl := range run {
				if bl.SaveAs != "" {
					// Never through a link into the repository (a page
					// naming Makefile or go.mod).
					if st, err := os.Lstat(filepath.Join(work, bl.SaveAs)); err == nil && st.Mode()&os.ModeSymlink != 0 {
						t.Fatalf("%s: <!-- file: %s --> names a file of the repository: pick another name", bl.Where(), bl.SaveAs)
					}
					if err := os.WriteFile(filepath.Join(work, bl.SaveAs), []byte(bl.Code), 0o600); err != nil {
						t.Fatalf("%s: %v", bl.Where(), err)
					}
					continue
				}
				ran++
				before := systemDirs()
				err := runBlock(t, work, env, state, bl)
				if changed := systemDirs().changedFrom(before); changed != "" {
					t.Fatalf("%s: the block changed %s: a block that installs or writes system files must be marked <!-- not run: ... -->", bl.Where(), changed)
				}
				if err != nil {
					t.Fatalf("%s: %v", bl.Where(), err)
				}
			}
		})
	}
	t.Logf("%d blocks run in %s, %d not run (marked)", ran, time.Since(start).Round(time.Second), skipped)
}

// runBlock runs one block in bash and checks its exit status and output.
// state carries the page's variables and working directory from block to
// block.
func runBlock(t *testing.T, dir string, env []string, state string, bl Block) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), blockTimeout)
	defer cancel()
	// A block that runs until interrupted gets SIGINT after its time, as
	// Ctrl-C would.
	var interrupted atomic.Bool
	if bl.StopsAfter > 0 {
		ctx, cancel = context.WithTimeout(ctx, bl.StopsAfter)
		defer cancel()
	}
	script := fmt.Sprintf(`__docrun_state=%q
[ -f "$__docrun_state" ] && source "$__docrun_state"
__docrun_save() {
  {
    for __v in $(compgen -v); do
      case " $__docrun_base " in *" $__v "*) ;; *)
        case "$__v" in BASH*|FUNCNAME|PIPESTATUS|_*) ;; *) declare -p "$__v" 2>/dev/null ;; esac ;;
      esac
    done
    export -p | grep -v -E '^declare -x (PWD|OLDPWD|SHLVL|_)='
    printf 'cd %%q\n' "$PWD"
  } >"$__docrun_state.new" && mv "$__docrun_state.new" "$__docrun_state"
}
trap __docrun_save EXIT
set -eo pipefail
%s`, state, bl.Code)
	cmd := exec.CommandContext(ctx, "bash", "-c", script)
	cmd.Dir = dir
	cmd.Env = append(slices.Clone(env), "__docrun_base="+baseVars(t, env)+" __v __docrun_state __docrun_base")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// exec calls Cancel once: a block that does not stop on its SIGINT
	// within interruptGrace is killed, and fails.
	var ignoredInterrupt atomic.Bool
	cmd.Cancel = func() error {
		if bl.StopsAfter > 0 && !interrupted.Swap(true) {
			pid := cmd.Process.Pid
			timer := time.AfterFunc(interruptGrace, func() {
				if syscall.Kill(-pid, 0) == nil {
					ignoredInterrupt.Store(true)
					_ = syscall.Kill(-pid, syscall.SIGKILL)
				}
			})
			t.Cleanup(func() { timer.Stop() })
			return syscall.Kill(-pid, syscall.SIGINT)
		}
		return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	// What a block leaves running in the background (a watch, a server)
	// may hold the output open: stop waiting for it shortly after the
	// block's shell exits.
	cmd.WaitDelay = 3 * time.Second
	began := time.Now()
	err := cmd.Run()
	if cmd.Process != nil {
		pid := cmd.Process.Pid
		t.Cleanup(func() { _ = syscall.Kill(-pid, syscall.SIGTERM) })
	}
	code := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case errors.Is(err, exec.ErrWaitDelay):
	case interrupted.Load(), errors.Is(err, context.DeadlineExceeded):
		// Stopped by its SIGINT, or killed at blockTimeout: below.
	case err != nil:
		return fmt.Errorf("run: %w", err)
	}
	report := fmt.Sprintf("\n--- block ---\n%s--- output (exit status %d after %s) ---\n%s", bl.Code, code, time.Since(began).Round(time.Millisecond), out.String())
	switch {
	case ignoredInterrupt.Load():
		return fmt.Errorf("did not stop within %s of its Ctrl-C (SIGINT)%s", interruptGrace, report)
	case bl.StopsAfter > 0 && !interrupted.Load():
		return fmt.Errorf("ended before its %s were up: a block marked stops after runs until interrupted%s", bl.StopsAfter, report)
	case bl.StopsAfter > 0:
		// Interrupted as the reader would: what it printed until then is
		// its output.
	case ctx.Err() != nil:
		return fmt.Errorf("did not end within %s%s", blockTimeout, report)
	case code != bl.Exit:
		return fmt.Errorf("exit status %d, want %d%s", code, bl.Exit, report)
	}
	if bl.HasOutput {
		if err := MatchOutput(bl.Output, out.String()); err != nil {
			return fmt.Errorf("%v%s\n--- the document shows ---\n%s", err, report, bl.Output)
		}
	}
	return nil
}

// baseVars are the names of the variables a fresh bash has in env: a
// block's state is what it set beyond them.
func baseVars(t *testing.T, env []string) string {
	t.Helper()
	cmd := exec.Command("bash", "-c", "compgen -v")
	cmd.Env = env
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("bash compgen -v: %v", err)
	}
	return strings.Join(strings.Fields(string(out)), " ")
}

// clusterScript runs scripts/cluster.sh with one command.
func clusterScript(t *testing.T, root, command string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(root, "scripts", "cluster.sh"), command)
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// clusterEnv is this process's environment with the exports make cluster
// printed applied, and a HOME of the run's own (pvcli keeps its contexts
// there).
func clusterEnv(t *testing.T, root, printed string) []string {
	t.Helper()
	var exports []string
	for l := range strings.Lines(printed) {
		if s := strings.TrimSpace(l); strings.HasPrefix(s, "export ") {
			exports = append(exports, s)
		}
	}
	if len(exports) == 0 {
		t.Fatalf("make cluster printed no export lines:\n%s", printed)
	}
	// Go's and npm's caches stay the machine's: a block that builds does
	// not download the world again into the new HOME.
	caches, err := exec.Command("go", "env", "GOPATH", "GOMODCACHE", "GOCACHE").Output()
	if err != nil {
		t.Fatalf("go env: %v", err)
	}
	var keep []string
	for k, v := range map[int]string{0: "GOPATH", 1: "GOMODCACHE", 2: "GOCACHE"} {
		if f := strings.Split(strings.TrimSpace(string(caches)), "\n"); k < len(f) {
			keep = append(keep, v+"="+f[k])
		}
	}
	if h, err := os.UserHomeDir(); err == nil {
		keep = append(keep, "npm_config_cache="+filepath.Join(h, ".npm"))
	}
	home := t.TempDir()
	cmd := exec.Command("bash", "-c", strings.Join(exports, "\n")+"\nenv -0")
	cmd.Dir = root
	cmd.Env = append(append(os.Environ(), keep...), "HOME="+home)
	for _, k := range []string{"PVCLI_CONFIG", "PVCLI_CONTEXT", "PVCLI_TOKEN", "XDG_CONFIG_HOME"} {
		cmd.Env = append(cmd.Env, k+"=")
	}
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("make cluster's exports: %v", err)
	}
	var env []string
	for kv := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		if k, v, _ := strings.Cut(kv, "="); v != "" || !slices.Contains([]string{"PVCLI_CONFIG", "PVCLI_CONTEXT", "PVCLI_TOKEN", "XDG_CONFIG_HOME"}, k) {
			env = append(env, kv)
		}
	}
	return env
}

// untrackedFiles lists the files git does not track nor ignore.
func untrackedFiles(t *testing.T, root string) map[string]bool {
	t.Helper()
	cmd := exec.Command("git", "ls-files", "--others", "--exclude-standard", "-z")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("git ls-files: %v", err)
	}
	files := map[string]bool{}
	for f := range strings.SplitSeq(strings.TrimRight(string(out), "\x00"), "\x00") {
		if f != "" {
			files[f] = true
		}
	}
	return files
}

// removeNewFiles removes the untracked files the blocks left in the
// repository (a snapshot saved, a file a page wrote).
func removeNewFiles(t *testing.T, root string, before map[string]bool) {
	for f := range untrackedFiles(t, root) {
		if !before[f] {
			t.Logf("removing %s, which a block wrote", f)
			_ = os.Remove(filepath.Join(root, f))
		}
	}
}

// watchedDirs are system directories a document's block must not write
// into (the runner may run as root): a block that installs a package or a
// unit, or makes /etc/pivirt, is one for a real node, marked not run.
// (/var/lib is left out: the machine's own services change it.)
var watchedDirs = []string{"/etc", "/usr/bin", "/usr/local/bin"}

// dirTimes are the modification times of watchedDirs (a file added to or
// removed from one changes its time).
type dirTimes map[string]time.Time

func systemDirs() dirTimes {
	d := dirTimes{}
	for _, p := range watchedDirs {
		if st, err := os.Stat(p); err == nil {
			d[p] = st.ModTime()
		}
	}
	return d
}

// changedFrom names the directories whose time differs from before.
func (d dirTimes) changedFrom(before dirTimes) string {
	var changed []string
	for _, p := range watchedDirs {
		if !d[p].Equal(before[p]) {
			changed = append(changed, p)
		}
	}
	return strings.Join(changed, ", ")
}

// workDir is the directory the blocks run in: a reader's checkout, as
// links to the repository's top-level entries (bin/, scripts/, docs/),
// where the files blocks write (a snapshot, a policy file) stay out of the
// repository, with a .cluster/ of its own: make cluster run here keeps
// its PKI, data and logs in it, and the documents start from a new
// cluster whatever the repository's .cluster/ holds.
func workDir(t *testing.T, root string) string {
	t.Helper()
	dir := t.TempDir()
	entries, err := os.ReadDir(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Name() == ".git" || e.Name() == ".cluster" {
			continue
		}
		if err := os.Symlink(filepath.Join(root, e.Name()), filepath.Join(dir, e.Name())); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}
