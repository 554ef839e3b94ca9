package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/input"
	"github.com/chromedp/chromedp"
)

// A VM's serial console in the web UI (xterm.js over the agent's
// WebSocket to VMService.Console), part of TestWebUI: its cluster and
// browser, one more tab.

// cutProxy relays TCP connections to an agent's API port and can cut them
// all at once, as a network blip does (the browser sees no close frame:
// 1006).
type cutProxy struct {
	ln    net.Listener
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func startCutProxy(t *testing.T, to string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, conns: map[net.Conn]struct{}{}}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		p.cut()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", to)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns[c], p.conns[u] = struct{}{}, struct{}{}
			p.mu.Unlock()
			wg.Add(2)
			pipe := func(dst, src net.Conn) {
				defer wg.Done()
				_, _ = io.Copy(dst, src)
				dst.Close()
				src.Close()
				p.mu.Lock()
				delete(p.conns, dst)
				delete(p.conns, src)
				p.mu.Unlock()
			}
			go pipe(u, c)
			go pipe(c, u)
		}
	}()
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

// cut closes every relayed connection (the listener stays: the browser
// reconnects through it).
func (p *cutProxy) cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
	}
	n := len(p.conns)
	clear(p.conns)
	return n
}

// termJS reads the terminal's screen as the user sees it: the rows of
// xterm's DOM renderer, one line each.
const termJS = `[...document.querySelectorAll('.console .xterm-rows > div')].map((d) => d.textContent.replace(/\u00a0/g, ' ').trimEnd()).join('\n')`

// waitTerm waits until the terminal shows s, wherever its lines wrap
// (white space is left out of the comparison).
func (b *tab) waitTerm(s string, timeout time.Duration) time.Duration {
	b.t.Helper()
	q, _ := json.Marshal(strings.Join(strings.Fields(s), ""))
	return b.waitJS(fmt.Sprintf("the terminal shows %q", s), timeout, fmt.Sprintf(`(%s).replace(/\s+/g, '').includes(%s)`, termJS, q))
}

func (b *tab) term() string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](termJS))
	if err != nil {
		b.fail("read the terminal", err)
	}
	return s
}

// typeTerm types into the terminal: the text as a keyboard's input events
// give it (chromedp's SendKeys sends a key's down and char events, which
// xterm takes as two), "\r" as the Enter key.
func (b *tab) typeTerm(s string) {
	b.t.Helper()
	b.run("type "+s, 20*time.Second, chromedp.Focus(chromedp.CSS(`.console textarea`)), chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
		for i, part := range strings.Split(s, "\r") {
			if i > 0 {
				down := input.DispatchKeyEventParams{Type: input.DispatchKeyEventTypeKeyDown, Key: "Enter", Code: "Enter", WindowsVirtualKeyCode: 13, NativeVirtualKeyCode: 13, Text: "\r"}
				up := down
				up.Type, up.Text = input.DispatchKeyEventTypeKeyUp, ""
				for _, k := range []input.DispatchKeyEventParams{down, up} {
					if _, err := chromedp.Call(ctx, input.DispatchKeyEvent, k); err != nil {
						return err
					}
				}
			}
			if part != "" {
				if _, err := chromedp.Call(ctx, input.InsertText, input.InsertTextParams{Text: part}); err != nil {
					return err
				}
			}
		}
		return nil
	}))
}

// sttySize runs stty size and answers what it printed (rows cols).
func (b *tab) sttySize(n int) string {
	b.t.Helper()
	marker := fmt.Sprintf("size-%d", n)
	b.typeTerm("stty size\r")
	b.typeTerm("echo " + marker + "\r")
	b.waitJS("stty size answered", 20*time.Second, fmt.Sprintf(`(%s).split('\n').some((l) => l === %q)`, termJS, marker))
	lines := strings.Split(b.term(), "\n")
	size := regexp.MustCompile(`^\d+ \d+$`)
	for i := len(lines) - 1; i >= 0; i-- {
		if lines[i] == marker {
			for j := i - 1; j >= 0; j-- {
				if size.MatchString(lines[j]) {
					return lines[j]
				}
			}
		}
	}
	b.t.Fatalf("no stty size output before %s in the terminal:\n%s", marker, strings.Join(lines, "\n"))
	return ""
}

// noCSPViolations checks that the page broke none of its
// Content-Security-Policy (listened for since openConsole).
func (b *tab) noCSPViolations() {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`window.cspViolations ?? []`))
	if err != nil {
		b.fail("read the CSP violations", err)
	}
	if len(v) > 0 {
		b.t.Errorf("the console broke the page's Content-Security-Policy: %q", v)
	}
}

// openConsole opens the console of a VM from its page, as a user does.
func (b *tab) openConsole(vmName string) {
	b.t.Helper()
	b.waitJS("listen for CSP violations", 5*time.Second, `(window.cspViolations ??= [], window.cspListening || (document.addEventListener('securitypolicyviolation', (e) => cspViolations.push(e.violatedDirective + ' ' + e.blockedURI)), window.cspListening = true), true)`)
	b.open("VMs")
	b.open(vmName)
	b.waitJS("the VM runs", 20*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'running'`)
	b.open("Console")
	b.waitTerm("root@"+vmName+":~#", 20*time.Second)
}

// hasLink tells whether the page has a link with this text.
func (b *tab) hasLink(text string) bool {
	b.t.Helper()
	q, _ := json.Marshal(text)
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](fmt.Sprintf(`[...document.querySelectorAll('a')].some((a) => a.textContent.trim() === %s)`, q)))
	if err != nil {
		b.fail("look for a link", err)
	}
	return ok
}

// testConsole: an admin opens the console of a running VM through a
// relay it can cut: a command and its answer, paste and copy, the size
// following the window, a reconnection after a cut, and exit 3 shown.
func testConsole(t *testing.T, e *uiEnv, n *node, vmName string) {
	start := time.Now()
	proxy := startCutProxy(t, n.api)
	b := e.newTab(t)
	b.login(&node{name: n.name, api: proxy.addr()}, "root", "admin")
	b.openConsole(vmName)
	t.Logf("the console's prompt appeared %s after the tab opened (its login included)", time.Since(start).Round(100*time.Millisecond))

	// xterm's run-time CSS applies (through constructed stylesheets) and
	// nothing broke the page's CSP.
	b.waitJS("xterm's CSS applies", 5*time.Second, `(() => { const r = getComputedStyle(document.querySelector('.console .xterm-rows')); return r.whiteSpace === 'pre' && r.pointerEvents === 'none'; })()`)
	b.noCSPViolations()

	b.typeTerm("uname -a\r")
	b.waitTerm("Linux "+vmName+" 6.1.0-pivirt-sim #1 SMP x86_64 GNU/Linux", 20*time.Second)
	b.shot("console")
	b.accessible("console")
	// Screen reader mode: the rows as an accessible tree.
	b.run("screen reader mode", 10*time.Second, chromedp.Click(`//label[normalize-space()='Screen reader mode']/input`))
	b.waitJS("the accessible rows", 10*time.Second, `(document.querySelector('.console .xterm-accessibility-tree')?.textContent ?? '').includes('6.1.0-pivirt-sim')`)
	b.accessible("console-screen-reader")
	b.run("screen reader mode off", 10*time.Second, chromedp.Click(`//label[normalize-space()='Screen reader mode']/input`))
	b.waitJS("the accessible rows gone", 10*time.Second, `!document.querySelector('.console .xterm-accessibility-tree')`)

	// Paste: the browser's paste event on the terminal types the text.
	b.waitJS("paste", 5*time.Second, `(() => {
		const dt = new DataTransfer();
		dt.setData('text/plain', 'echo pasted-$?-text\r');
		document.querySelector('.console textarea').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true}));
		return true;
	})()`)
	b.waitJS("the pasted command ran", 20*time.Second, fmt.Sprintf(`(%s).split('\n').includes('pasted-0-text')`, termJS))
	// Copy: the selection goes to the clipboard on the browser's copy.
	b.waitJS("copy", 10*time.Second, `(() => {
		const rows = document.querySelector('.console .xterm-screen');
		const box = rows.getBoundingClientRect();
		const opts = {bubbles: true, cancelable: true, button: 0, clientX: box.left + 2, clientY: box.top + 2};
		rows.dispatchEvent(new MouseEvent('mousedown', {...opts, detail: 3}));
		document.dispatchEvent(new MouseEvent('mouseup', opts));
		const dt = new DataTransfer();
		document.querySelector('.console textarea').dispatchEvent(new ClipboardEvent('copy', {clipboardData: dt, bubbles: true, cancelable: true}));
		return dt.getData('text/plain').includes('pivirtd-sim serial console of');
	})()`)

	// A paste larger than a frame (64 KiB) goes in several; the session
	// stays open (the shell's line takes 4096 and rings for the rest).
	b.waitJS("a big paste", 5*time.Second, `(() => {
		const dt = new DataTransfer();
		dt.setData('text/plain', 'x'.repeat(150 * 1024));
		document.querySelector('.console textarea').dispatchEvent(new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true}));
		return true;
	})()`)
	b.typeTerm("\recho after-big-paste\r")
	b.waitJS("the session goes on after a big paste", 20*time.Second, fmt.Sprintf(`(%s).split('\n').includes('after-big-paste') && document.querySelector('[data-testid=console-state]')?.textContent === 'Connected.'`, termJS))

	// The size follows the window.
	before := b.sttySize(1)
	b.run("a smaller window", 10*time.Second, chromedp.EmulateViewport(800, 520))
	var after string
	for i := 2; ; i++ {
		after = b.sttySize(i)
		if after != before {
			break
		}
		if i > 10 {
			t.Fatalf("stty size stays %q after the window shrank", before)
		}
	}
	rows, _, _ := strings.Cut(after, " ")
	b.waitJS("stty's rows are the terminal's", 5*time.Second, fmt.Sprintf(`document.querySelectorAll('.console .xterm-rows > div').length === %s`, rows))
	t.Logf("stty size: %s in a 1280x800 window, %s in 800x520", before, after)
	b.run("the window back", 10*time.Second, chromedp.EmulateReset())

	// A cut connection is opened again, and the terminal says so.
	if n := proxy.cut(); n == 0 {
		t.Fatal("no connection to cut")
	}
	b.waitTerm("Connecting again in 1 s (attempt 1 of 8): the connection to the agent was lost (1006).", 20*time.Second)
	took := b.waitJS("connected again", 30*time.Second, `(() => {
		const flat = (`+termJS+`).replace(/\s+/g, '');
		return document.querySelector('[data-testid=console-state]')?.textContent === 'Connected.' &&
			flat.lastIndexOf('theconnectiontotheagentwaslost(1006)') < flat.lastIndexOf('pivirtd-simserialconsoleof');
	})()`)
	t.Logf("the console was open again %s after the cut was shown", took.Round(100*time.Millisecond))
	b.typeTerm("hostname\r")
	b.waitJS("the new session answers", 20*time.Second, fmt.Sprintf(`(%s).split('\n').filter((l) => l === %q).length >= 1`, termJS, vmName))

	// exit 3 ends the session, which says why; it is not opened again.
	b.typeTerm("exit 3\r")
	b.waitJS("the end shown", 20*time.Second, `document.querySelector('[data-testid=console-state]')?.textContent === 'The session ended: the shell exited (exit status 3).'`)
	b.waitTerm("[The session ended: the shell exited (exit status 3).]", 5*time.Second)
	b.waitText("Connect again", 5*time.Second)
	b.shot("console-closed")
	b.noCSPViolations()
	t.Logf("the console's test took %s", time.Since(start).Round(100*time.Millisecond))
}

// testConsoleOwner: a vm-owner opens its own VM's console and is refused
// another owner's, in pvcli's words.
func testConsoleOwner(t *testing.T, b *tab, ownVM, othersID string) {
	start := time.Now()
	b.openConsole(ownVM)
	b.typeTerm("hostname\r")
	b.waitJS("alice's console answers", 20*time.Second, fmt.Sprintf(`(%s).split('\n').includes(%q)`, termJS, ownVM))
	b.waitJS("open another owner's console by URL", 10*time.Second, fmt.Sprintf(`(history.pushState(null, '', '/ui/vms/%s/console'), dispatchEvent(new Event('pivirt:navigate')), true)`, othersID))
	b.waitText("The agent's RBAC policy does not allow this call for your identity", 30*time.Second)
	b.waitText("the console did not open", 5*time.Second)
	if strings.Contains(b.term(), "serial console of") {
		t.Errorf("vm-owner alice sees another owner's console:\n%s", b.term())
	}
	b.shot("console-denied")
	b.accessible("console-denied")
	t.Logf("vm-owner's consoles took %s", time.Since(start).Round(100*time.Millisecond))
}

// noConsoleButton: a role without the console verb (b's) gets no Console
// button on a running VM's page.
func noConsoleButton(t *testing.T, b *tab, vmName string) {
	b.open("VMs")
	b.open(vmName)
	b.waitJS("the VM's page", 20*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'running'`)
	if b.hasLink("Console") {
		t.Errorf("a role without the console verb is offered the Console button")
	}
}
