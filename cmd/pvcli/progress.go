package main

import (
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// isTerminal reports whether w is a terminal: the default of
// app.terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// progress shows how far a long transfer got on stderr: the bytes moved,
// the rate and, when the total is known, the time left. A nil *progress
// shows nothing, so callers need no checks.
type progress struct {
	bar   *progressbar.ProgressBar
	known bool  // the total is known
	moved int64 // bytes moved so far
}

// newProgress starts the progress of a transfer of total bytes (-1:
// unknown) described by what, or returns nil when progress is off: stderr
// is not a terminal (a script, a pipe, a test), TERM is dumb, or
// --no-progress was given.
func (a *app) newProgress(total int64, what string) *progress {
	if a.opts.noProgress || a.getenv("TERM") == "dumb" || !a.terminal(a.stderr) {
		return nil
	}
	if total == 0 {
		total = -1
	}
	stderr := a.stderr
	bar := progressbar.NewOptions64(total,
		progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription(what),
		progressbar.OptionShowBytes(true),
		progressbar.OptionShowTotalBytes(true),
		progressbar.OptionShowCount(),
		progressbar.OptionSetWidth(20),
		progressbar.OptionThrottle(100*time.Millisecond),
		// Redrawn only when bytes move: no goroutine of its own, which
		// would redraw after the transfer failed.
		progressbar.OptionSetSpinnerChangeInterval(0),
		progressbar.OptionOnCompletion(func() { fmt.Fprintln(stderr) }),
	)
	return &progress{bar: bar, known: total > 0}
}

// add counts n more bytes moved.
func (p *progress) add(n int) {
	if p != nil && n > 0 {
		p.moved += int64(n)
		_ = p.bar.Add(n)
	}
}

// done draws the final state (the total moved, the average rate) and
// ends the line.
func (p *progress) done() {
	if p == nil || p.bar.IsFinished() {
		return
	}
	if p.moved == 0 {
		_ = p.bar.Exit()
		return
	}
	if p.known && p.moved != p.bar.GetMax64() {
		// Not the size announced (the file changed meanwhile): show
		// what was moved as the whole.
		p.bar.ChangeMax64(p.moved)
	}
	_ = p.bar.Finish()
}

// stop ends the line where the transfer stopped, so that an error message
// starts on a line of its own. It does nothing after done.
func (p *progress) stop() {
	if p != nil && !p.bar.IsFinished() {
		_ = p.bar.Exit()
	}
}
