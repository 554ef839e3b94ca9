package e2e_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/chromedp"
)

// The web UI in a real browser: Debian's headless Chromium driven with
// chromedp against three real agents (each with its pivirtd-sim), the
// development OIDC issuer of pitrust and the reference RBAC policy of
// make cluster. Screenshots of every view go to PIVIRT_UI_SCREENSHOTS
// (default bin/ui-screenshots in the repository), and with
// UPDATE_SCREENSHOTS=1 the pictures docs/getting-started.md shows (docsShots,
// in docs/ui) are replaced.

// repoRoot is the repository, relative to this package's directory.
const repoRoot = "../../.."

// referencePolicy is make cluster's RBAC policy, read from
// scripts/cluster.sh (the heredoc that writes rbac.yaml), so that the
// console is tried under the policy a newcomer gets.
func referencePolicy(t *testing.T) string {
	b, err := os.ReadFile(filepath.Join(repoRoot, "scripts", "cluster.sh"))
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "cat >\"$dir/rbac.yaml\" <<'YAML'\n")
	policy, _, ok2 := strings.Cut(rest, "\nYAML\n")
	if !ok || !ok2 || !strings.Contains(policy, "vm-owner") {
		t.Fatal("scripts/cluster.sh: no rbac.yaml heredoc with the vm-owner role")
	}
	return policy + "\n"
}

// chromiumPath finds Debian's Chromium; in CI a missing one fails (.ci/run
// installs it), elsewhere the test is skipped with how to get it.
func chromiumPath(t *testing.T) string {
	for _, name := range []string{"chromium", "chromium-headless-shell", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("no Chromium: .ci/run installs Debian's chromium package")
	}
	t.Skip("no Chromium to drive: apt-get install chromium (CI installs it)")
	return ""
}

// uiEnv is a cluster with the development issuer and a browser.
type uiEnv struct {
	c        *cluster
	secret   string
	issuer   string
	alloc    context.Context
	shotsDir string
	axe      string
}

func startUIEnv(t *testing.T) *uiEnv {
	chrome := chromiumPath(t)
	axe, err := os.ReadFile(filepath.Join(repoRoot, "node_modules", "axe-core", "axe.min.js"))
	if err != nil {
		t.Fatalf("axe-core (npm ci installs it; make test runs npm ci): %v", err)
	}
	bins := buildBinaries(t)
	dir := t.TempDir()
	c := &cluster{bins: bins, dir: dir, tokens: true}
	c.certs = makePKI(t, filepath.Join(dir, "certs"))

	issuer := c.startDevIssuer(t, c.certs)
	secret, err := os.ReadFile(filepath.Join(c.certs, "dev-oidc.secret"))
	if err != nil {
		t.Fatal(err)
	}
	policy := filepath.Join(dir, "rbac.yaml")
	if err := os.WriteFile(policy, []byte(referencePolicy(t)), 0o600); err != nil {
		t.Fatal(err)
	}
	c.authExtra = fmt.Sprintf("  oidc:\n    issuer_url: %s\n    allow_http_issuer: true\n    client_id: pivirt-agent\n  rbac_policy: %s\n", issuer, policy)
	startClusterOn(t, c)

	shots := os.Getenv("PIVIRT_UI_SCREENSHOTS")
	if shots == "" {
		shots = filepath.Join(repoRoot, "bin", "ui-screenshots")
	}
	if err := os.MkdirAll(shots, 0o755); err != nil {
		t.Fatal(err)
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chrome),
		chromedp.NoSandbox,
		chromedp.WindowSize(1280, 800),
		// The agents' certificates are of the test's own PiTrust CA.
		chromedp.IgnoreCertErrors,
		chromedp.Flag("lang", "en-US"),
	)
	alloc, cancel := chromedp.NewExecAllocator(t.Context(), opts...)
	t.Cleanup(cancel)
	return &uiEnv{c: c, secret: strings.TrimSpace(string(secret)), issuer: issuer, alloc: alloc, shotsDir: shots, axe: string(axe)}
}

// docsShots are the screenshots docs/getting-started.md shows (docs/ui).
var docsShots = map[string]bool{"overview": true, "vm": true, "schedule": true, "console": true}

// tab is one browser tab: its own page and memory, so its own login.
type tab struct {
	env *uiEnv
	ctx context.Context
	t   *testing.T
}

func (e *uiEnv) newTab(t *testing.T) *tab {
	ctx, cancel := chromedp.NewContext(e.alloc)
	t.Cleanup(cancel)
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start the browser: %v", err)
	}
	return &tab{env: e, ctx: ctx, t: t}
}

// run runs browser actions with a deadline.
func (b *tab) run(what string, timeout time.Duration, actions ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, timeout)
	defer cancel()
	if err := chromedp.Do(ctx, actions...); err != nil {
		b.fail(what, err)
	}
}

// fail ends the test with the page's text, which says what the user saw.
func (b *tab) fail(what string, err error) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	page, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body ? document.body.innerText.slice(0, 3000) : ""`))
	b.t.Fatalf("%s: %v\npage %s text:\n%s", what, err, b.url(), page)
}

func (b *tab) url() string {
	ctx, cancel := context.WithTimeout(b.ctx, 5*time.Second)
	defer cancel()
	u, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`location.href`))
	return u
}

// waitJS polls a JavaScript condition in the page until it is true.
func (b *tab) waitJS(what string, timeout time.Duration, cond string) time.Duration {
	b.t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		// A poll ends when the page navigates (the login's redirects):
		// poll again in the new page until the deadline.
		left := time.Until(deadline)
		ctx, cancel := context.WithTimeout(b.ctx, left+time.Second)
		_, err := chromedp.Run(ctx, chromedp.Poll[chromedp.Void](cond, chromedp.WithPollingTimeout(left), chromedp.WithPollingInterval(100*time.Millisecond)))
		cancel()
		if err == nil {
			return time.Since(start)
		}
		if !time.Now().Before(deadline) || b.ctx.Err() != nil {
			b.fail(what, err)
		}
	}
}

// waitText waits until the page's text contains s.
func (b *tab) waitText(s string, timeout time.Duration) time.Duration {
	b.t.Helper()
	q, _ := json.Marshal(s)
	return b.waitJS(fmt.Sprintf("text %q", s), timeout, fmt.Sprintf(`document.body.innerText.includes(%s)`, q))
}

func (b *tab) text() string {
	ctx, cancel := context.WithTimeout(b.ctx, 10*time.Second)
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
	if err != nil {
		b.fail("read the page", err)
	}
	return s
}

// login logs in through the development issuer's form.
func (b *tab) login(n *node, user, roles string) {
	b.t.Helper()
	b.run("open the UI", 30*time.Second, chromedp.Navigate("https://"+n.api+"/"))
	b.waitText("Log in", 20*time.Second)
	b.run("go to the issuer", 30*time.Second,
		chromedp.Click(`button.primary`),
		chromedp.WaitVisible(`input[name=user]`),
		chromedp.SendKeys(`input[name=user]`, user),
		chromedp.SendKeys(`input[name=roles]`, roles),
		chromedp.SendKeys(`input[name=password]`, b.env.secret),
		chromedp.Submit(`form`),
	)
	b.waitJS("logged in as "+user, 30*time.Second, fmt.Sprintf(`(document.querySelector('[data-testid=identity]')?.textContent ?? '') === %q`, user))
}

// open follows an in-app link by its text, as a user clicks it.
func (b *tab) open(linkText string) {
	b.t.Helper()
	q, _ := json.Marshal(linkText)
	b.run("open "+linkText, 20*time.Second, chromedp.Poll[chromedp.Void](fmt.Sprintf(`(() => {
		const a = [...document.querySelectorAll('a')].find((a) => a.textContent.trim() === %s);
		if (!a) return false;
		a.click();
		return true;
	})()`, q), chromedp.WithPollingTimeout(15*time.Second), chromedp.WithPollingInterval(100*time.Millisecond)))
}

// shot saves a screenshot of the viewport as name.png.
func (b *tab) shot(name string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 20*time.Second)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.fail("screenshot "+name, err)
	}
	path := filepath.Join(b.env.shotsDir, name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
	if os.Getenv("UPDATE_SCREENSHOTS") != "" && docsShots[name] {
		docs := filepath.Join(repoRoot, "docs", "ui")
		if err := os.MkdirAll(docs, 0o755); err != nil {
			b.t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(docs, name+".png"), png, 0o644); err != nil {
			b.t.Fatal(err)
		}
	}
}

// axeViolation is one finding of axe-core.
type axeViolation struct {
	ID     string `json:"id"`
	Impact string `json:"impact"`
	Help   string `json:"help"`
	Nodes  []struct {
		Target []any  `json:"target"`
		HTML   string `json:"html"`
	} `json:"nodes"`
}

// accessible runs axe-core (WCAG 2 A and AA rules) on the page and fails on
// a serious or critical violation.
func (b *tab) accessible(view string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 60*time.Second)
	defer cancel()
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](b.env.axe+";true")); err != nil {
		b.fail("load axe-core", err)
	}
	found, err := chromedp.Run(ctx, chromedp.Evaluate[[]axeViolation](`axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21a', 'wcag21aa']}}).then((r) => r.violations)`, chromedp.EvalAwaitPromise))
	if err != nil {
		b.fail("axe on "+view, err)
	}
	for _, v := range found {
		if v.Impact == "serious" || v.Impact == "critical" {
			var where []string
			for _, n := range v.Nodes {
				where = append(where, n.HTML)
			}
			b.t.Errorf("axe on %s: %s (%s): %s\n  %s", view, v.ID, v.Impact, v.Help, strings.Join(where, "\n  "))
		}
	}
}

func TestWebUI(t *testing.T) {
	e := startUIEnv(t)
	c := e.c
	n1, n2, n3 := c.nodes[0], c.nodes[1], c.nodes[2]

	// Objects on every node, some of them alice's.
	vmOn := map[string]string{}
	for _, n := range c.nodes {
		for _, owner := range []string{"alice", "bob"} {
			var created struct {
				VM vmOut `json:"vm"`
			}
			c.okJSON(t, n1, &created, "-o", "json", "vm", "create", owner+"-"+n.name, "--vcpus", "1", "--memory-mib", "256", "--host", n.name, "--owner", owner)
			vmOn[owner+"-"+n.name] = created.VM.ID
		}
		c.ok(t, n1, "volume", "create", "disk-"+n.name, "--size", "1MiB", "--host", n.name)
		c.ok(t, n1, "network", "create", "net-"+n.name, "--cidr", "10.9."+n.name[4:]+".0/24", "--host", n.name)
	}
	c.ok(t, n2, "service", "register", "web", "--address", "10.0.0.5", "--port", "8080", "--tag", "v1", "--ttl", "1h")
	c.ok(t, n1, "config", "set", "logging.level", "debug")
	c.ok(t, n1, "config", "set", "logging.level", "info")

	admin := e.newTab(t)
	admin.login(n1, "root", "admin")

	t.Run("overview", func(t *testing.T) {
		admin.t = t
		admin.waitJS("three members alive", 20*time.Second, `['node1','node2','node3'].every((n) => (document.querySelector('[data-testid=member-'+n+']')?.textContent ?? '') === 'alive')`)
		admin.waitText("Healthy", 20*time.Second)
		admin.shot("overview")
		admin.accessible("overview")
	})

	t.Run("start a VM on another node", func(t *testing.T) {
		admin.t = t
		id := vmOn["alice-node3"]
		admin.open("VMs")
		admin.waitText("bob-node2", 20*time.Second)
		admin.shot("vms")
		admin.accessible("vms")
		admin.open("alice-node3")
		admin.waitJS("the VM's page", 20*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'stopped'`)
		admin.run("start it", 20*time.Second,
			chromedp.Click(`//button[normalize-space()='Start']`),
			chromedp.WaitVisible(`dialog[open]`),
		)
		admin.shot("vm-confirm")
		admin.run("confirm", 20*time.Second, chromedp.Click(`//dialog//button[normalize-space()='Start']`))
		admin.waitJS("the VM runs", 30*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'running'`)
		var got struct {
			VM vmOut `json:"vm"`
		}
		c.okJSON(t, n2, &got, "-o", "json", "vm", "get", id)
		if got.VM.PowerState != "POWER_STATE_RUNNING" || got.VM.Host != n3.name {
			t.Fatalf("after Start in the UI of %s, pvcli sees %+v", n1.name, got.VM)
		}
		admin.shot("vm")
	})

	t.Run("a VM's console", func(t *testing.T) {
		testConsole(t, e, n1, "alice-node3")
	})

	t.Run("VM actions", func(t *testing.T) {
		admin.t = t
		vmActionsAsAdmin(t, admin, c)
	})

	t.Run("volumes and networks", func(t *testing.T) {
		admin.t = t
		volumesAndNetworks(t, admin, c)
	})

	t.Run("a schedule's runs appear", func(t *testing.T) {
		admin.t = t
		id := vmOn["bob-node2"]
		c.ok(t, n1, "schedule", "create", "--id", "reboot-bob", "--vm", id, "--action", "power-on", "--cron", "@every 2s")
		admin.open("Schedules")
		admin.waitText("reboot-bob", 20*time.Second)
		admin.open("reboot-bob")
		took := admin.waitJS("a run appears", 30*time.Second, `[...document.querySelectorAll('[data-testid=run-outcome]')].some((e) => e.textContent === 'ok')`)
		t.Logf("the first run appeared in the UI %s after the schedule's page opened", took.Round(100*time.Millisecond))
		admin.shot("schedule")
		admin.accessible("schedule")
		c.ok(t, n1, "schedule", "pause", "reboot-bob")
	})

	t.Run("schedule actions", func(t *testing.T) {
		admin.t = t
		scheduleActions(t, admin, c, vmOn["alice-node2"])
	})

	t.Run("other views", func(t *testing.T) {
		admin.t = t
		for _, v := range []struct{ link, text, shot string }{
			{"Services", "web", "services"},
			{"Volumes", "disk-node2", "volumes"},
			{"Networks", "net-node3", "networks"},
			{"Settings", "logging.level", "settings"},
			{"Snapshots", "Take a snapshot", "snapshots"},
			{"Logs", "Log of node1", "logs"},
		} {
			admin.open(v.link)
			admin.waitText(v.text, 20*time.Second)
			admin.shot(v.shot)
			admin.accessible(v.shot)
		}
		admin.open("Settings")
		admin.open("logging.level")
		admin.waitText("Diff", 20*time.Second)
		admin.shot("setting-history")
		admin.accessible("setting-history")
	})

	t.Run("deregister a service", func(t *testing.T) {
		admin.t = t
		deregisterService(t, admin, c)
	})

	t.Run("set and roll back a setting", func(t *testing.T) {
		admin.t = t
		settingActions(t, admin, c)
	})

	t.Run("dark theme", func(t *testing.T) {
		admin.t = t
		admin.run("dark", 10*time.Second, chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
			_, err := chromedp.Call(ctx, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{Features: []*emulation.MediaFeature{{Name: "prefers-color-scheme", Value: "dark"}}})
			return err
		}))
		admin.open("Overview")
		admin.waitJS("dark colours", 10*time.Second, `getComputedStyle(document.body).backgroundColor !== 'rgb(255, 255, 255)'`)
		admin.waitText("Healthy", 20*time.Second)
		admin.shot("overview-dark")
		admin.accessible("overview-dark")
		admin.run("light", 10*time.Second, chromedp.Func(func(ctx context.Context, _ *chromedp.Target) error {
			_, err := chromedp.Call(ctx, emulation.SetEmulatedMedia, emulation.SetEmulatedMediaParams{})
			return err
		}))
	})

	t.Run("keyboard", func(t *testing.T) {
		admin.t = t
		admin.open("Overview")
		admin.waitText("Healthy", 20*time.Second)
		// The skip link comes first; Enter on a focused link of the
		// navigation opens its view and puts the focus on it; Tab goes on
		// from there.
		admin.waitJS("the skip link is first", 5*time.Second, `document.querySelector('a[href], button, input, select, [tabindex]:not([tabindex="-1"])')?.textContent === 'Skip to content'`)
		admin.run("focus Schedules", 10*time.Second, chromedp.Focus(`//nav//a[normalize-space()='Schedules']`), chromedp.KeyEvent("\r"))
		admin.waitJS("Enter opened Schedules", 10*time.Second, `location.pathname === '/ui/schedules' && document.activeElement?.id === 'main'`)
		// Tab alone reaches a schedule's link in the view (at most 40
		// presses), and Enter opens it.
		reached := false
		for range 40 {
			admin.run("tab", 10*time.Second, chromedp.KeyEvent("\t"))
			ctx, cancel := context.WithTimeout(admin.ctx, 5*time.Second)
			text, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.activeElement?.textContent ?? ''`))
			cancel()
			if err != nil {
				admin.fail("read the focus", err)
			}
			if text == "reboot-bob" {
				reached = true
				break
			}
		}
		if !reached {
			t.Fatal("40 presses of Tab did not reach the link of schedule reboot-bob")
		}
		admin.run("enter", 10*time.Second, chromedp.KeyEvent("\r"))
		admin.waitJS("Enter opened the schedule", 10*time.Second, `location.pathname === '/ui/schedules/reboot-bob'`)
	})

	t.Run("inspect a snapshot before restoring it", func(t *testing.T) {
		admin.t = t
		archive := filepath.Join(t.TempDir(), "backup.tar.gz")
		c.ok(t, n1, "snapshot", "save", archive)
		// A change after the archive: the restore takes it back.
		c.ok(t, n1, "config", "set", "kv/ui-after-save", "x")
		admin.open("Snapshots")
		admin.waitText("Take a snapshot", 20*time.Second)
		admin.run("upload", 20*time.Second, chromedp.SetUploadFiles(`input[type=file]`, []string{archive}))
		admin.waitJS("the plan", 30*time.Second, `!!document.querySelector('[data-testid=plan]') && document.body.innerText.includes('What the restore changes')`)
		admin.waitText("Restore this archive", 5*time.Second)
		admin.shot("snapshot-plan")
		admin.accessible("snapshot-plan")
		saveAndRestore(t, admin, c)
	})

	t.Run("phone width", func(t *testing.T) {
		admin.t = t
		admin.run("phone", 10*time.Second, chromedp.EmulateViewport(390, 844, chromedp.EmulateScale(2), chromedp.EmulateMobile))
		admin.open("VMs")
		admin.waitText("alice-node1", 20*time.Second)
		admin.shot("phone-vms")
		admin.accessible("phone-vms")
		admin.run("desktop", 10*time.Second, chromedp.EmulateReset())
	})

	t.Run("vm-owner sees only its own", func(t *testing.T) {
		owner := e.newTab(t)
		owner.login(n2, "alice", "vm-owner")
		owner.waitText("alice-node3", 20*time.Second)
		page := owner.text()
		for _, hidden := range []string{"bob-node1", "Overview", "Settings", "Snapshots", "Schedules", "Volumes"} {
			if strings.Contains(page, hidden) {
				t.Errorf("vm-owner alice sees %q:\n%s", hidden, page)
			}
		}
		owner.shot("vm-owner")
		// A view the role may not read, opened by its URL, says so in
		// pvcli's words.
		owner.waitJS("open settings by URL", 10*time.Second, `(history.pushState(null, '', '/ui/settings'), dispatchEvent(new Event('pivirt:navigate')), true)`)
		owner.waitText("The agent's RBAC policy does not allow this call for your identity", 20*time.Second)
		owner.open("VMs")
		owner.waitText("alice-node1", 20*time.Second)
		if got := owner.buttons(); len(got) != 0 {
			t.Errorf("vm-owner is offered %q on the VMs' list, want no create", got)
		}
		owner.open("alice-node1")
		owner.waitJS("alice's VM page", 20*time.Second, `(document.querySelector('[data-testid=power]')?.textContent ?? '') === 'stopped'`)
		owner.waitText("Start", 10*time.Second)
		// Its own VM's power and edit, no delete and no create.
		if got := strings.Join(owner.buttons(), ","); got != "Start,Stop,Reboot,Power off,Edit" {
			t.Errorf("vm-owner is offered %q on its VM's page, want the power actions and Edit", got)
		}
		testConsoleOwner(t, owner, "alice-node3", vmOn["bob-node2"])
	})

	t.Run("roles without the actions", func(t *testing.T) {
		rolesWithoutActions(t, e, c, vmOn["bob-node1"])
	})

	t.Run("access control off", func(t *testing.T) {
		plainConsole(t, e)
	})

	t.Run("a node goes down", func(t *testing.T) {
		admin.t = t
		admin.open("Overview")
		admin.waitJS("three members alive", 20*time.Second, `(document.querySelector('[data-testid=member-node3]')?.textContent ?? '') === 'alive'`)
		// A console served by node3 itself, which is about to go.
		on3 := e.newTab(t)
		on3.login(n3, "root", "admin")
		on3.waitText("Healthy", 20*time.Second)
		c.kill(t, n3)
		on3.waitText("Cannot connect to the agent ("+n3.api+")", 30*time.Second)
		on3.shot("agent-unreachable")
		took := admin.waitJS("node3 shown down", 30*time.Second, `['failed','suspect'].includes(document.querySelector('[data-testid=member-node3]')?.textContent ?? '')`)
		t.Logf("node3 shown down in the overview %s after it was killed", took.Round(100*time.Millisecond))
		admin.shot("node-down")

		// Without a quorum: the overview says so, and a write answers
		// with pvcli's words.
		c.kill(t, n2)
		took = admin.waitJS("no leader shown", 30*time.Second, `(document.querySelector('[data-testid=quorum]')?.textContent ?? '').startsWith('No leader')`)
		t.Logf("no leader shown in the overview %s after the second node was killed", took.Round(100*time.Millisecond))
		admin.shot("no-leader")
		admin.open("Snapshots")
		admin.run("take a snapshot", 20*time.Second, chromedp.Click(`//button[normalize-space()='Take a snapshot']`))
		admin.waitText("The cluster has no leader: writes and default or consistent reads wait for one.", 90*time.Second)
		admin.shot("no-leader-error")
	})
}
