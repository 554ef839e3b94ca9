package e2e_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

// readmePath is the README, relative to this package's directory.
const readmePath = "../../../README.md"

// quickStartLineTimeout bounds one line of the quick start: its blocking
// query may wait its --wait 1m when the index is not yet past its
// --wait-index (the step checks that it answered at once instead).
const quickStartLineTimeout = 90 * time.Second

// quickStartOutcome is what the step does with a line of the quick start
// and what it expects of it.
type quickStartOutcome int

const (
	// qsExport: the line is put before every later line run.
	qsExport quickStartOutcome = iota
	// qsOK: run through bash; exit status 0 wanted.
	qsOK
	// qsOKOrConflict: run through bash; exit status 0, or the refusal of
	// a compare-and-set whose revision is no longer current. The README
	// says to give the revision the set before printed; the line keeps
	// its literal revision, which the agent is right to refuse.
	qsOKOrConflict
	// qsKill: the node whose pid file the line reads is SIGKILLed by the
	// harness (make cluster's pid files do not exist here).
	qsKill
	// qsNotRun: make targets; the harness builds the binaries and stops
	// the cluster itself.
	qsNotRun
)

// quickStartLines says, first match wins, what happens to each line of
// the quick start (continuation lines joined, comment cut). A line that
// none matches fails the step: add it here or make it runnable.
var quickStartLines = []struct {
	re      *regexp.Regexp
	outcome quickStartOutcome
}{
	{regexp.MustCompile(`^export [A-Z_]+=`), qsExport},
	{regexp.MustCompile(`^pvcli [^;|&$<>` + "`" + `]* --cas [0-9]+$`), qsOKOrConflict},
	// pvcli commands, several joined by ";", with <ID> as their only
	// placeholder.
	{regexp.MustCompile(`^pvcli ([^;|&$<>` + "`" + `]|<ID>)*(; pvcli ([^;|&$<>` + "`" + `]|<ID>)*)*$`), qsOK},
	{regexp.MustCompile(`^kill "\$\(cat \.cluster/(node[0-9]+)\.pid\)"$`), qsKill},
	{regexp.MustCompile(`^make [a-z-]+$`), qsNotRun},
}

// casConflict is how pvcli reports a compare-and-set refused.
var casConflict = regexp.MustCompile(`(aborted|failed_precondition): compare-and-set conflict`)

// quickStartReplacer turns make cluster's addresses and paths into the
// harness cluster's: node1..node3's API ports, the PKI and the binaries.
func (c *cluster) quickStartReplacer() *strings.Replacer {
	return strings.NewReplacer(
		"127.0.0.1:8443", c.nodes[0].api,
		"127.0.0.1:8453", c.nodes[1].api,
		"127.0.0.1:8463", c.nodes[2].api,
		"$PWD/.cluster/certs", c.certs,
		"$PWD/bin", filepath.Dir(c.bins.pvcli),
	)
}

// quickStartBlock is the sh block after "For example:" under the README's
// "## Quick start", as logical lines: continuation lines joined.
func quickStartBlock(t testing.TB) []string {
	t.Helper()
	b, err := os.ReadFile(readmePath)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	i := strings.Index(doc, "\n## Quick start\n")
	if i < 0 {
		t.Fatal("README.md has no \"## Quick start\" section")
	}
	doc = doc[i:]
	if j := strings.Index(doc[1:], "\n## "); j >= 0 {
		doc = doc[:j+1]
	}
	// The block after "For example:", its docs-run marker (this test runs
	// it, not make docs-run) between them.
	m := regexp.MustCompile("For example:\n\n(<!-- not run: [^\n]*-->\n)?```sh\n").FindStringIndex(doc)
	if m == nil {
		t.Fatal("README.md's quick start has no sh block after \"For example:\"")
	}
	doc = doc[m[1]:]
	end := strings.Index(doc, "\n```")
	if end < 0 {
		t.Fatal("README.md's quick start block does not end")
	}
	var lines []string
	cur := ""
	for l := range strings.SplitSeq(doc[:end], "\n") {
		if before, ok := strings.CutSuffix(l, "\\"); ok {
			cur += before
			continue
		}
		lines = append(lines, cur+l)
		cur = ""
	}
	return lines
}

// withoutComment is line without its trailing comment and spaces.
func withoutComment(line string) string {
	if i := strings.Index(line, " #"); i >= 0 {
		line = line[:i]
	}
	return strings.TrimSpace(line)
}

// classifyQuickStart is the outcome of the first entry of quickStartLines
// that matches text, with the submatches; -1 if none does.
func classifyQuickStart(text string) (quickStartOutcome, []string) {
	for _, l := range quickStartLines {
		if m := l.re.FindStringSubmatch(text); m != nil {
			return l.outcome, m
		}
	}
	return -1, nil
}

func unknownQuickStartLine(line string) string {
	return fmt.Sprintf("README.md's quick start has the line\n%s\nwhich quickStartLines does not know: add it there or make it runnable", line)
}

// TestReadmeQuickStartLines: quickStartLines knows every line of the
// README's quick start, so that TestClusterLifecycle runs them all.
func TestReadmeQuickStartLines(t *testing.T) {
	n := 0
	for _, line := range quickStartBlock(t) {
		text := withoutComment(line)
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		n++
		if o, _ := classifyQuickStart(text); o < 0 {
			t.Error(unknownQuickStartLine(line))
		}
	}
	if n < 10 {
		t.Errorf("only %d lines in README.md's quick start", n)
	}
}

// quickStartExamples runs the README's quick start against the cluster,
// as written but for the addresses and paths of quickStartReplacer and the
// VM ID the block's vm create printed for <ID>, in a shell with HOME and
// PVCLI_CONFIG of its own. It SIGKILLs the node the block kills, and
// returns that node (nil if none).
func (c *cluster) quickStartExamples(t *testing.T) *node {
	home := t.TempDir()
	env := append(raceEnv(), "HOME="+home, "XDG_CONFIG_HOME=", "PVCLI_CONFIG="+filepath.Join(home, "no-pvcli-config.yaml"),
		"PVCLI_ENDPOINT=", "PVCLI_CONTEXT=", "PVCLI_TOKEN=", "PVCLI_CA_FILE=", "PVCLI_CERT_FILE=", "PVCLI_KEY_FILE=")
	repl := c.quickStartReplacer()
	var exports []string
	var vmIDs []string
	var killed *node
	ran := 0
	for _, line := range quickStartBlock(t) {
		text := withoutComment(line)
		if text == "" || strings.HasPrefix(text, "#") {
			continue
		}
		outcome, m := classifyQuickStart(text)
		switch outcome {
		case qsExport:
			exports = append(exports, repl.Replace(line))
			continue
		case qsNotRun:
			continue
		case qsKill:
			killed = c.byName(t, m[1])
			c.kill(t, killed)
			t.Logf("%s: SIGKILLed %s", text, killed.name)
			continue
		case qsOK, qsOKOrConflict:
		default:
			t.Fatalf("%s", unknownQuickStartLine(line))
		}

		cmdLine := repl.Replace(line)
		if strings.Contains(cmdLine, "<ID>") {
			if len(vmIDs) == 0 {
				t.Fatalf("%s: <ID> before any vm create", line)
			}
			cmdLine = strings.ReplaceAll(cmdLine, "<ID>", vmIDs[len(vmIDs)-1])
		}
		if strings.Contains(cmdLine, "127.0.0.1:84") || strings.Contains(cmdLine, "$PWD") {
			t.Fatalf("%s: an address or path of make cluster is left after the substitutions: %s", line, cmdLine)
		}
		start := time.Now()
		stdout, stderr, code := c.bash(t, env, strings.Join(append(exports, cmdLine), "\n"))
		ran++
		res := fmt.Sprintf("README line\n%s\nrun as\n%s\nexit status %d after %s\nstdout: %s\nstderr: %s",
			line, cmdLine, code, time.Since(start).Round(time.Millisecond), strings.TrimSpace(stdout), strings.TrimSpace(stderr))
		switch {
		case code == 0:
		case outcome == qsOKOrConflict && casConflict.MatchString(stderr):
			t.Logf("%s\n(the compare-and-set conflict the README allows for)", res)
			continue
		default:
			t.Fatalf("%s\nwant exit status 0", res)
		}
		if strings.Contains(text, " vm create ") {
			id, err := tableColumn(stdout, "ID")
			if err != nil {
				t.Fatalf("%s\n%v", res, err)
			}
			vmIDs = append(vmIDs, id)
		}
		// A blocking query must have answered because its index passed,
		// not because its wait ran out.
		if m := regexp.MustCompile(`--wait-index ([0-9]+)`).FindStringSubmatch(text); m != nil {
			want, _ := strconv.ParseUint(m[1], 10, 64)
			got := regexp.MustCompile(`(?m)^Pivirt-Index: ([0-9]+)$`).FindStringSubmatch(stderr)
			if got == nil {
				t.Fatalf("%s\nwant the Pivirt-Index header on stderr (-v)", res)
			}
			if idx, _ := strconv.ParseUint(got[1], 10, 64); idx <= want {
				t.Fatalf("%s\nwant an index above %d", res, want)
			}
		}
	}
	if ran < 10 {
		t.Fatalf("ran only %d pvcli lines of README.md's quick start", ran)
	}

	// Leave the cluster as the later steps expect it.
	via := c.others(killed)[0]
	c.ok(t, via, "service", "deregister", "web", "web-"+c.nodes[2].name)
	c.ok(t, via, "config", "delete", "kv/maintenance.window")
	for _, id := range vmIDs {
		var got struct {
			VM vmOut `json:"vm"`
		}
		c.okJSON(t, via, &got, "vm", "get", id)
		if got.VM.PowerState == "POWER_STATE_RUNNING" {
			c.ok(t, via, "vm", "stop", id, "--shutdown-timeout", "5s")
		}
		c.ok(t, via, "vm", "delete", id)
	}
	return killed
}

// bash runs script with bash -e in env, within quickStartLineTimeout.
func (c *cluster) bash(t testing.TB, env []string, script string) (stdout, stderr string, code int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), quickStartLineTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-e", "-c", script)
	cmd.Env = env
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	cmd.WaitDelay = time.Second
	dieWithTest(cmd)
	err := cmd.Run()
	var exit *exec.ExitError
	switch {
	case ctx.Err() != nil:
		t.Fatalf("bash -e -c %q: still running after %s\nstdout: %s\nstderr: %s", script, quickStartLineTimeout, &out, &errb)
	case err == nil:
	case errors.As(err, &exit):
		code = exit.ExitCode()
	default:
		t.Fatalf("bash -e -c %q: %v", script, err)
	}
	if strings.Contains(errb.String(), raceMarker) {
		t.Errorf("the race detector reported a race in pvcli:\n%s", &errb)
	}
	return out.String(), errb.String(), code
}

// tableColumn is the value in column name of the only row of a pvcli
// table.
func tableColumn(table, name string) (string, error) {
	rows := strings.Split(strings.TrimSpace(table), "\n")
	if len(rows) != 2 {
		return "", fmt.Errorf("want a header and one row, got %d lines", len(rows))
	}
	header, row := strings.Fields(rows[0]), strings.Fields(rows[1])
	for i, h := range header {
		if h == name && i < len(row) {
			return row[i], nil
		}
	}
	return "", fmt.Errorf("no column %s in %q", name, rows[0])
}
