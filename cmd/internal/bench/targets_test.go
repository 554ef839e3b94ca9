package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"testing"
)

// target is one performance target's outcome in a run: what was measured,
// against what, and each round's own value, so that a verdict made of
// disagreeing rounds shows as such.
type target struct {
	bench string    // the benchmark that measured it
	what  string    // the target, e.g. "write c=64 ÷ etcd (leader)"
	got   float64   // over every round
	want  float64   // the goal
	le    bool      // pass when got <= want (latency, memory), else got >= want
	unit  string    // printed after the numbers ("" for a ratio)
	round []float64 // each round's value, when the benchmark has rounds
	skip  string    // why the target could not be measured in this run
}

func (t target) pass() bool {
	if t.le {
		return t.got <= t.want
	}
	return t.got >= t.want
}

func (t target) verdict() string {
	switch {
	case t.skip != "":
		return "SKIPPED"
	case t.pass():
		return "PASS"
	}
	return "BELOW"
}

func (t target) line() string {
	if t.skip != "" {
		return fmt.Sprintf("  %-7s %-58s (%s)", t.verdict(), t.what, t.skip)
	}
	cmp := ">="
	if t.le {
		cmp = "<="
	}
	s := fmt.Sprintf("  %-7s %-58s %8s%s (want %s %s%s)", t.verdict(), t.what, num(t.got), t.unit, cmp, num(t.want), t.unit)
	if len(t.round) > 0 {
		r := make([]string, len(t.round))
		for i, v := range t.round {
			r[i] = num(v)
		}
		s += "  rounds: " + strings.Join(r, " ")
	}
	return s
}

// num prints a ratio with two decimals and larger values without.
func num(v float64) string {
	if v >= 100 || v <= -100 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

var targets struct {
	sync.Mutex
	list []target
}

// reportTarget prints t's verdict line to out now and keeps it for the
// summary printed after every benchmark of the run.
func reportTarget(out io.Writer, t target) {
	fmt.Fprintln(out, t.line())
	targets.Lock()
	targets.list = append(targets.list, t)
	targets.Unlock()
}

// TestMain prints, after the benchmarks, every target they reported in one
// table: `make bench`'s last lines are the run's verdicts.
func TestMain(m *testing.M) {
	code := m.Run()
	printTargets(os.Stdout)
	os.Exit(code)
}

func printTargets(out io.Writer) {
	targets.Lock()
	defer targets.Unlock()
	if len(targets.list) == 0 {
		return
	}
	counts := map[string]int{}
	fmt.Fprintf(out, "\ntargets of this run (a report, never a failure; PASS, BELOW or SKIPPED, with each round's value):\n")
	bench := ""
	for _, t := range targets.list {
		if t.bench != bench {
			bench = t.bench
			fmt.Fprintf(out, "%s\n", bench)
		}
		fmt.Fprintln(out, t.line())
		counts[t.verdict()]++
	}
	fmt.Fprintf(out, "%d targets: %d PASS, %d BELOW, %d SKIPPED\n", len(targets.list), counts["PASS"], counts["BELOW"], counts["SKIPPED"])
}
