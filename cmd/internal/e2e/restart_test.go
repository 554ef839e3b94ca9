package e2e_test

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.etcd.io/bbolt"

	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
	"pilab.hu/pivirt-agent/store/storetest"
)

// matrixService holds the registrations the restart matrix writes.
const matrixService = "mx"

// stopMode is how every agent is stopped: SIGTERM (a clean shutdown,
// which must exit 0) or SIGKILL.
type stopMode string

// startMode is how they start again: all at once, or one at a time, each
// caught up before the next stops (a rolling restart, as an upgrade does).
type startMode string

const (
	sigterm stopMode  = "sigterm"
	sigkill stopMode  = "sigkill"
	allAt   startMode = "all-at-once"
	rolling startMode = "rolling"
)

// matrixOp is one documented operation of the restart matrix. do performs
// it on m's cluster and keeps m.want in step with what it does to the
// registrations.
type matrixOp struct {
	name string
	do   func(m *matrix, t *testing.T)
	// after, when set, checks after the restart what the operation left.
	after func(m *matrix, t *testing.T)
}

// matrixCase is an operation with a way to stop and a way to start.
type matrixCase struct {
	op    string
	stop  stopMode
	start startMode
}

// matrixCases are the cases to run: all of them under PIVIRT_RESTART_MATRIX=1
// (make restart-matrix, which CI runs), else a few that cover each kind of
// log Raft leaves behind, each restart mode and each stop mode.
func matrixCases(ops []matrixOp, short []matrixCase) []matrixCase {
	if os.Getenv("PIVIRT_RESTART_MATRIX") == "" {
		return short
	}
	only := regexp.MustCompile(os.Getenv("PIVIRT_RESTART_OPS")) // "": every operation
	var all []matrixCase
	for _, op := range ops {
		if !only.MatchString(op.name) {
			continue
		}
		for _, stop := range []stopMode{sigterm, sigkill} {
			for _, start := range []startMode{allAt, rolling} {
				all = append(all, matrixCase{op.name, stop, start})
			}
		}
	}
	return all
}

// TestRestartMatrix does each documented operation, writes after it, stops
// every agent (SIGTERM, or SIGKILL) and starts them again from the same
// data dirs (all at once, or one at a time): every agent must start, a
// leader must be elected, every acknowledged registration — before and
// after the operation, less what a restore replaced — must be readable
// with a consistent read through every agent, and the next write must
// succeed. The agents snapshot every 64 entries and keep 32 behind, so the
// logs they restart from have been compacted, restored over and installed
// by snapshot.
func TestRestartMatrix(t *testing.T) {
	if testing.Short() {
		t.Skip("stops and starts real processes")
	}
	bins := buildBinaries(t)
	m := newMatrix(t, bins)
	ops := m.raftOps()
	cases := matrixCases(ops, []matrixCase{
		{"snapshot restore through a follower", sigkill, allAt},
		{"snapshot restore through the leader", sigterm, rolling},
		{"snapshot install on a lagging follower", sigkill, rolling},
		{"recover", sigterm, allAt},
		{"cluster-CA renewal", sigkill, allAt},
		{"pitrust revoke", sigterm, rolling},
		{"log store migration", sigterm, rolling},
	})
	m.runCases(t, ops, cases)
}

// TestEtcdRestartMatrix is the matrix of etcd mode's own operation, a
// restore: the agents keep no Raft log, but their mirrors, schedule
// leadership and dedupe records must survive every restart.
func TestEtcdRestartMatrix(t *testing.T) {
	if testing.Short() {
		t.Skip("stops and starts real processes and an etcd")
	}
	bins := buildBinaries(t)
	ec := etcdtest.Start(t, 1)
	etcdYAML := "service_discovery:\n  type: etcd\n  etcd:\n    endpoints:\n"
	for _, ep := range ec.Endpoints {
		etcdYAML += "      - " + ep + "\n"
	}
	m := &matrix{c: startClusterWith(t, bins, etcdYAML), want: map[string]bool{}, dir: t.TempDir(), client: fmt.Sprintf("matrix-%x", mrand.Uint64())}
	m.connect(t)
	ops := []matrixOp{
		{"etcd snapshot restore", func(m *matrix, t *testing.T) { m.restore(t, m.follower(t)) }, nil},
		{"cluster setting", (*matrix).setting, (*matrix).settingApplied},
	}
	m.runCases(t, ops, matrixCases(ops, []matrixCase{{"etcd snapshot restore", sigkill, allAt}, {"cluster setting", sigkill, rolling}}))
}

// matrix is the cluster of the restart matrix and what it must hold.
type matrix struct {
	c      *cluster
	api    []clusterv1connect.ClusterServiceClient
	dir    string
	client string // the write identity's client ID
	seq    uint64
	// want are the instance IDs of matrixService that must be there.
	want map[string]bool
	// key is the gossip key in use (keyring rotation).
	key string
	// ca is the PiTrust CA server of the "pitrust revoke" operation (nil
	// before its first case); leaked the stem of the certificate it
	// revoked last.
	ca     *caServer
	leaked string
	// level and levelRev: the cluster setting logging.level the "cluster
	// setting" operation wrote, and its revision.
	level    string
	levelRev uint64
}

func newMatrix(t *testing.T, bins binaries) *matrix {
	t.Helper()
	dir := t.TempDir()
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		t.Fatal(err)
	}
	keyFile := filepath.Join(dir, "gossip.key")
	if err := os.WriteFile(keyFile, []byte(base64.StdEncoding.EncodeToString(key)), 0o600); err != nil {
		t.Fatal(err)
	}
	c := &cluster{bins: bins, dir: t.TempDir()}
	// The cluster CA renews the agents' certificates on demand (their
	// files start long-lived; the CA renewal case makes them short-lived).
	c.tlsExtra = `  cluster_ca:
    enabled: true
    cert_file: {certs}/PiCA.pem
    key_file: {certs}/PiCA.key
    leaf_ttl: 1h
`
	c.extra = fmt.Sprintf(`cluster:
  gossip:
    encrypt_key_file: %s
  raft:
    snapshot_threshold: 64
    snapshot_interval: 200ms
    trailing_logs: 32
`, keyFile)
	startClusterOn(t, c)
	m := &matrix{c: c, want: map[string]bool{}, dir: dir, key: base64.StdEncoding.EncodeToString(key), client: fmt.Sprintf("matrix-%x", mrand.Uint64())}
	m.connect(t)
	return m
}

func (m *matrix) connect(t *testing.T) {
	hc := m.c.httpClient(t)
	m.api = make([]clusterv1connect.ClusterServiceClient, len(m.c.nodes))
	for i, n := range m.c.nodes {
		m.api[i] = clusterv1connect.NewClusterServiceClient(hc, "https://"+n.api)
	}
}

// runCases runs the cases: for each, the operation, a write, the stop and
// start, the checks and a write after them.
func (m *matrix) runCases(t *testing.T, ops []matrixOp, cases []matrixCase) {
	t.Helper()
	for range 5 {
		m.write(t) // state from before every operation
	}
	start := time.Now()
	for _, mc := range cases {
		i := slices.IndexFunc(ops, func(o matrixOp) bool { return o.name == mc.op })
		if i < 0 {
			t.Fatalf("no operation %q", mc.op)
		}
		name := fmt.Sprintf("%s/%s/%s", mc.op, mc.stop, mc.start)
		began := time.Now()
		ops[i].do(m, t)
		m.write(t)
		switch mc.start {
		case allAt:
			m.restartAll(t, mc.stop)
		case rolling:
			m.rollingRestart(t, mc.stop)
		}
		m.verify(t, name)
		if ops[i].after != nil {
			ops[i].after(m, t)
		}
		m.write(t)
		t.Logf("%-60s ok in %s (%d registrations checked on every node)", name, time.Since(began).Round(100*time.Millisecond), len(m.want))
	}
	t.Logf("%d cases (operation × stop × start) in %s", len(cases), time.Since(start).Round(time.Second))
}

// --- writes and checks -------------------------------------------------------

// write registers a new instance through a random running agent, sending
// it again with the same identity until it is answered, and adds it to
// want.
func (m *matrix) write(t *testing.T) string {
	t.Helper()
	m.seq++
	id := fmt.Sprintf("w%04d", m.seq)
	req := &clusterv1.RegisterServiceRequest{
		Instance: &clusterv1.ServiceInstance{Service: matrixService, InstanceId: id, Address: "10.1.0.1", Port: 80},
		Write:    &clusterv1.WriteOptions{ClientId: m.client, Sequence: m.seq},
	}
	m.c.eventually(t, 60*time.Second, "registration "+id, func() error {
		i := mrand.IntN(len(m.api))
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, err := m.api[i].RegisterService(ctx, connect.NewRequest(req))
		if err != nil {
			return fmt.Errorf("via %s: %w", m.c.nodes[i].name, err)
		}
		return nil
	})
	m.want[id] = true
	return id
}

// writeMany writes n registrations through 4 concurrent clients.
func (m *matrix) writeMany(t *testing.T, n int) {
	t.Helper()
	var (
		mu  sync.Mutex
		ids []string
		wg  sync.WaitGroup
		bad []error
	)
	base := m.seq
	m.seq += uint64(n)
	for w := range 4 {
		wg.Go(func() {
			for k := w; k < n; k += 4 {
				seq := base + uint64(k) + 1
				id := fmt.Sprintf("w%04d", seq)
				req := &clusterv1.RegisterServiceRequest{
					Instance: &clusterv1.ServiceInstance{Service: matrixService, InstanceId: id, Address: "10.1.0.2", Port: 80},
					Write:    &clusterv1.WriteOptions{ClientId: m.client, Sequence: seq},
				}
				deadline := time.Now().Add(60 * time.Second)
				for {
					i := mrand.IntN(len(m.api))
					if m.c.nodes[i].proc == nil {
						continue // stopped by the operation
					}
					ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
					_, err := m.api[i].RegisterService(ctx, connect.NewRequest(req))
					cancel()
					if err == nil {
						mu.Lock()
						ids = append(ids, id)
						mu.Unlock()
						break
					}
					if time.Now().After(deadline) {
						mu.Lock()
						bad = append(bad, fmt.Errorf("%s: %w", id, err))
						mu.Unlock()
						break
					}
					time.Sleep(100 * time.Millisecond) // between retries of one write
				}
			}
		})
	}
	wg.Wait()
	if len(bad) > 0 {
		t.Fatalf("%d writes not answered within 60s: %v", len(bad), bad[:min(5, len(bad))])
	}
	for _, id := range ids {
		m.want[id] = true
	}
}

// verify checks, through every agent with a consistent read, that the
// registrations are exactly want.
func (m *matrix) verify(t *testing.T, what string) {
	t.Helper()
	want := slices.Sorted(maps.Keys(m.want))
	for i, n := range m.c.nodes {
		m.c.eventually(t, 60*time.Second, what+": every registration through "+n.name, func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			resp, err := m.api[i].ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{
				Service: matrixService,
				Read:    &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT},
			}))
			if err != nil {
				return err
			}
			var got []string
			for _, in := range resp.Msg.GetInstances() {
				got = append(got, in.GetInstanceId())
			}
			slices.Sort(got)
			if !slices.Equal(got, want) {
				return fmt.Errorf("%d registrations, want %d; missing %v, unexpected %v", len(got), len(want), missing(want, got), missing(got, want))
			}
			return nil
		})
	}
	m.c.agreeReplicas(t, what)
}

// missing returns the first few elements of a that b lacks (both sorted).
func missing(a, b []string) []string {
	var out []string
	for _, s := range a {
		if _, found := slices.BinarySearch(b, s); !found {
			out = append(out, s)
			if len(out) == 5 {
				break
			}
		}
	}
	return out
}

// --- stops and starts ----------------------------------------------------------

// stopAgents stops the agents of nodes at the same time, as a power cut or
// a `systemctl stop` on every node does; a SIGTERM must end in exit 0.
func (m *matrix) stopAgents(t *testing.T, mode stopMode, nodes ...*node) {
	t.Helper()
	for _, n := range nodes {
		if mode == sigkill {
			if err := n.proc.cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
				t.Fatalf("kill %s: %v", n.name, err)
			}
		} else {
			n.proc.cancel()
		}
	}
	for _, n := range nodes {
		p := n.proc
		<-p.done // a SIGTERM is followed by a SIGKILL after termGrace
		if code := p.cmd.ProcessState.ExitCode(); mode == sigterm && code != 0 {
			t.Errorf("%s after SIGTERM: %s, want exit status 0", n.name, p.state())
		}
		n.proc = nil
	}
}

// restartAll stops every agent and starts them all again.
func (m *matrix) restartAll(t *testing.T, mode stopMode) {
	t.Helper()
	m.stopAgents(t, mode, m.c.nodes...)
	for _, n := range m.c.nodes {
		m.c.mustStart(t, n, false)
	}
	m.waitLeader(t)
}

// rollingRestart stops and starts one agent after the other, each serving
// consistent reads again before the next one stops.
func (m *matrix) rollingRestart(t *testing.T, mode stopMode) {
	t.Helper()
	for i, n := range m.c.nodes {
		m.stopAgents(t, mode, n)
		m.c.restart(t, n)
		m.waitLeader(t)
		m.c.eventually(t, 60*time.Second, n.name+" serving consistent reads after its restart", func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := m.api[i].ListServices(ctx, connect.NewRequest(&clusterv1.ListServicesRequest{
				Service: matrixService, Read: &clusterv1.ReadOptions{Consistency: clusterv1.Consistency_CONSISTENCY_CONSISTENT}}))
			return err
		})
	}
}

// waitLeader waits until every agent runs and they agree on a leader.
func (m *matrix) waitLeader(t *testing.T) leaderOut {
	t.Helper()
	var l leaderOut
	m.c.eventually(t, 60*time.Second, "an agreed leader", func() error {
		var err error
		l, err = m.c.agreedLeader(t, m.c.nodes...)
		return err
	})
	return l
}

func (m *matrix) leader(t *testing.T) *node {
	t.Helper()
	return m.c.byAPI(t, m.waitLeader(t).APIAddr)
}

func (m *matrix) follower(t *testing.T) *node {
	t.Helper()
	l := m.leader(t)
	return m.c.others(l)[mrand.IntN(len(m.c.nodes)-1)]
}

// waitVoters waits until the leader counts three voters, every one of
// them serving.
func (m *matrix) waitVoters(t *testing.T) {
	t.Helper()
	m.c.eventually(t, 90*time.Second, "three voters", func() error {
		l, err := m.c.agreedLeader(t, m.c.nodes...)
		if err != nil {
			return err
		}
		var peers peersOut
		if err := m.c.tryJSON(t, m.c.byAPI(t, l.APIAddr), &peers, "--timeout", "5s", "cluster", "peers"); err != nil {
			return err
		}
		if v := peers.voters(); len(v) != 3 {
			return fmt.Errorf("voters %v", v)
		}
		for _, p := range peers.Peers {
			if p.State == "unreachable" || p.State == "" {
				return fmt.Errorf("%s is %q", p.Name, p.State)
			}
		}
		return nil
	})
}

// logCount counts the lines of n's log that contain s.
func logCount(t *testing.T, n *node, s string) int {
	t.Helper()
	b, err := os.ReadFile(n.log)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), s)
}

// --- the operations ------------------------------------------------------------

func (m *matrix) raftOps() []matrixOp {
	return []matrixOp{
		{"snapshot restore through the leader", func(m *matrix, t *testing.T) { m.restore(t, m.leader(t)) }, nil},
		{"snapshot restore through a follower", func(m *matrix, t *testing.T) { m.restore(t, m.follower(t)) }, nil},
		{"automatic snapshots and log compaction", (*matrix).compaction, nil},
		{"snapshot install on a lagging follower", (*matrix).installSnapshot, nil},
		{"recover", (*matrix).recover, nil},
		{"keyring install, use and remove", (*matrix).keyring, nil},
		{"certificate rotation", (*matrix).rotateCerts, nil},
		{"cluster-CA renewal", (*matrix).caRenewal, nil},
		{"pitrust revoke", (*matrix).pitrustRevoke, (*matrix).revokedRefused},
		{"POST /reload", (*matrix).reload, nil},
		{"cluster setting", (*matrix).setting, (*matrix).settingApplied},
		{"cluster leave and rejoin", (*matrix).leaveRejoin, nil},
		{"remove-peer", (*matrix).removePeer, nil},
		{"transfer-leader", (*matrix).transferLeader, nil},
		{"log store migration", (*matrix).migrateLogStores, nil},
	}
}

// migrateLogStores converts every agent's Raft log to the other store, one
// agent at a time, as docs/backup.md's steps say: stop it, run
// `pivirt-agent raft migrate-log-store`, start it, wait for it to catch
// up. An agent whose data dir keeps boltdb while its configuration asks
// for the default WAL says so when it starts.
func (m *matrix) migrateLogStores(t *testing.T) {
	t.Helper()
	for _, n := range m.c.nodes {
		to := "wal"
		if _, err := os.Stat(filepath.Join(n.dataDir, "raft", "wal")); err == nil {
			to = "boltdb"
		}
		m.stopAgents(t, sigterm, n)
		out, err := exec.Command(m.c.bins.agent, "raft", "migrate-log-store", "--data-dir", n.dataDir, "--to", to).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "to "+to) {
			t.Fatalf("pivirt-agent raft migrate-log-store on %s --to %s: %v\n%s", n.name, to, err, out)
		}
		configured := "wal" // the harness runs node1 on boltdb
		if n == m.c.nodes[0] {
			configured = "boltdb"
		}
		word := "holds a " + to + " raft log and keeps it"
		warned := logCount(t, n, word)
		m.c.restart(t, n)
		m.waitVoters(t)
		m.write(t)
		if to != configured {
			m.c.eventually(t, 30*time.Second, n.name+" saying it keeps "+to, func() error {
				if logCount(t, n, word) <= warned {
					return errors.New("no word on the log store at start")
				}
				return nil
			})
		}
	}
	m.verify(t, "after every agent changed its log store")
}

// restore saves an archive, writes one more registration (which the
// restore takes away again) and restores the archive through via.
func (m *matrix) restore(t *testing.T, via *node) {
	t.Helper()
	archive := filepath.Join(m.dir, fmt.Sprintf("restore-%d.tar.gz", m.seq))
	m.c.ok(t, m.leader(t), "snapshot", "save", archive)
	saved := maps.Clone(m.want)
	gone := m.write(t)
	r := m.c.ok(t, via, "snapshot", "restore", archive)
	if !strings.Contains(r.stdout, "Restored snapshot") {
		t.Fatalf("%s\nwant the restore's confirmation", r)
	}
	m.want = saved
	delete(m.want, gone)
}

// compaction writes until every agent has snapshotted and compacted its
// log again.
func (m *matrix) compaction(t *testing.T) {
	t.Helper()
	before := make([]int, len(m.c.nodes))
	for i, n := range m.c.nodes {
		before[i] = logCount(t, n, "compacting logs")
	}
	for attempt := 0; ; attempt++ {
		m.writeMany(t, 80)
		done := true
		for i, n := range m.c.nodes {
			done = done && logCount(t, n, "compacting logs") > before[i]
		}
		if done {
			return
		}
		if attempt == 5 {
			t.Fatalf("no log compaction on every agent after %d writes", 80*(attempt+1))
		}
	}
}

// installSnapshot stops a follower, writes until the leader compacted its
// log past it, and starts it again: it must catch up by a snapshot
// install.
func (m *matrix) installSnapshot(t *testing.T) {
	t.Helper()
	f := m.follower(t)
	installs := logCount(t, f, "Installed remote snapshot")
	l := m.leader(t) // asked before f stops: m.leader asks every agent
	compactions := logCount(t, l, "compacting logs")
	m.stopAgents(t, sigkill, f)
	m.writeMany(t, 200)
	// Raft checks for a snapshot every 200-400 ms here: the writes may be
	// done before the leader compacted its log past f. Two compactions
	// after f stopped leave none of the entries f lacks (64 entries per
	// snapshot, 32 kept behind it).
	for attempt := 0; logCount(t, l, "compacting logs") < compactions+2; attempt++ {
		if attempt == 5 {
			t.Fatalf("%s never compacted its log while %s was down", l.name, f.name)
		}
		m.writeMany(t, 80)
	}
	m.c.restart(t, f)
	m.c.eventually(t, 60*time.Second, f.name+" installs a snapshot", func() error {
		if logCount(t, f, "Installed remote snapshot") <= installs {
			return errors.New("no snapshot installed yet")
		}
		return nil
	})
}

// recover stops every agent, runs `pivirt-agent recover` on each with the
// three of them in the peers file, and starts them again.
func (m *matrix) recover(t *testing.T) {
	t.Helper()
	var peers []map[string]string
	for _, n := range m.c.nodes {
		id, err := os.ReadFile(filepath.Join(n.dataDir, identity.NodeIDFile))
		if err != nil {
			t.Fatal(err)
		}
		peers = append(peers, map[string]string{"id": strings.TrimSpace(string(id)), "address": n.raft})
	}
	b, err := json.Marshal(peers)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(m.dir, "peers.json")
	if err := os.WriteFile(file, b, 0o600); err != nil {
		t.Fatal(err)
	}
	m.stopAgents(t, sigterm, m.c.nodes...)
	m.recoverRefusesDamage(t, m.c.nodes[0], file)
	for _, n := range m.c.nodes {
		out, err := exec.Command(m.c.bins.agent, "recover", "--data-dir", n.dataDir, "--peers", file).CombinedOutput()
		if err != nil {
			t.Fatalf("pivirt-agent recover on %s: %v\n%s", n.name, err, out)
		}
	}
	for _, n := range m.c.nodes {
		m.c.mustStart(t, n, false)
	}
	m.waitLeader(t)
}

// recoverRefusesDamage runs `pivirt-agent recover` on a copy of n's data
// dir whose newest log entry is garbled: it must refuse, naming the file
// and the entry.
func (m *matrix) recoverRefusesDamage(t *testing.T, n *node, peers string) {
	t.Helper()
	cp := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", n.dataDir, cp).CombinedOutput(); err != nil {
		t.Fatalf("copy %s: %v\n%s", n.dataDir, err, out)
	}
	path := filepath.Join(cp, "raft", "raft.db")
	var last uint64
	storetest.EditLog(t, cp, func(b *bbolt.Bucket, newest uint64) error {
		last = newest
		return b.Put(storetest.LogKey(newest), []byte{0xc1, 0xff, 0x00})
	})
	out, err := exec.Command(m.c.bins.agent, "recover", "--data-dir", cp, "--peers", peers).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "the raft log is damaged") || !strings.Contains(string(out), path) ||
		!strings.Contains(string(out), fmt.Sprintf("entry %d", last)) {
		t.Fatalf("pivirt-agent recover on a data dir with entry %d garbled: %v\n%s\nwant a refusal naming %s and the entry", last, err, out, path)
	}
}

// keyring rotates the gossip key through a random agent, as
// docs/operations.md documents.
func (m *matrix) keyring(t *testing.T) {
	t.Helper()
	n := m.c.nodes[mrand.IntN(len(m.c.nodes))]
	next := strings.TrimSpace(m.c.ok(t, n, "cluster", "keyring", "generate").stdout)
	m.c.ok(t, n, "cluster", "keyring", "install", next)
	m.c.ok(t, n, "cluster", "keyring", "use", next)
	m.c.ok(t, n, "cluster", "keyring", "remove", m.key)
	m.key = next
}

// rotateCerts issues every agent new certificates (same names, new keys)
// and has each agent read them: its API must present the new one.
func (m *matrix) rotateCerts(t *testing.T) {
	t.Helper()
	m.reissue(t, 0)
	for _, n := range m.c.nodes {
		m.postReload(t, n)
	}
	for _, n := range m.c.nodes {
		want := m.serial(t, filepath.Join(m.c.certs, n.name+"-server.crt"))
		m.c.eventually(t, 30*time.Second, n.name+" presenting its new certificate", func() error {
			if got := presented(t, m.c.clientTLS(t), n.api); got != want {
				return fmt.Errorf("serial %s, want %s", got, want)
			}
			return nil
		})
	}
}

// caRenewal makes every agent's certificates short-lived and waits until
// the cluster CA renewed each of them (server and client certificate).
func (m *matrix) caRenewal(t *testing.T) {
	t.Helper()
	m.reissue(t, 20*time.Second)
	files := func(n *node) []string {
		return []string{filepath.Join(m.c.certs, n.name+"-server.crt"), filepath.Join(m.c.certs, "pivirt-agent-"+n.name+".crt")}
	}
	short := map[string]string{}
	for _, n := range m.c.nodes {
		for _, f := range files(n) {
			short[f] = m.serial(t, f)
		}
		m.postReload(t, n)
	}
	for _, n := range m.c.nodes {
		m.c.eventually(t, 60*time.Second, n.name+"'s certificates renewed by the cluster CA", func() error {
			for _, f := range files(n) {
				if m.serial(t, f) == short[f] {
					return fmt.Errorf("%s: still the short-lived certificate", filepath.Base(f))
				}
			}
			if p, want := presented(t, m.c.clientTLS(t), n.api), m.serial(t, files(n)[0]); p != want {
				return fmt.Errorf("presents %s, the file holds %s", p, want)
			}
			return nil
		})
	}
}

// pitrustRevoke starts the PiTrust CA server on the cluster's CA (once),
// has it issue an operator certificate, and revokes it: after the restart
// every agent must refuse it (revokedRefused), the fresh CRL of its start
// telling it so.
func (m *matrix) pitrustRevoke(t *testing.T) {
	t.Helper()
	if m.ca == nil {
		m.ca = startCAServerOn(t, m.c, m.c.certs, false)
	}
	m.leaked = fmt.Sprintf("operator-leaked-%d", time.Now().UnixNano())
	m.ca.request(t, "--kind", "mtls-client", "--name", "operator", "--out", m.leaked)
	if r := m.c.pvcliEnv(t, m.leakedEnv(), "--endpoint", "https://"+m.c.nodes[0].api, "--timeout", "5s", "cluster", "members"); r.code != 0 {
		t.Fatalf("the operator certificate before its revocation: %s", r)
	}
	m.ca.pitrust(t, append(append([]string{"revoke", serial(t, filepath.Join(m.c.certs, m.leaked+".crt"))}, m.ca.admin()...), "--reason", "keyCompromise")...)
}

// revokedRefused: every agent refuses the certificate pitrustRevoke
// revoked.
func (m *matrix) revokedRefused(t *testing.T) {
	t.Helper()
	for _, n := range m.c.nodes {
		m.c.eventually(t, 10*time.Second, n.name+" refuses the revoked operator certificate", func() error {
			if r := m.c.pvcliEnv(t, m.leakedEnv(), "--endpoint", "https://"+n.api, "--timeout", "5s", "cluster", "members"); r.code == 0 {
				return errors.New("still accepted")
			}
			return nil
		})
	}
}

// leakedEnv is pvcli's environment with the revoked operator certificate.
func (m *matrix) leakedEnv() []string {
	return []string{"PVCLI_CA_FILE=" + filepath.Join(m.c.certs, identity.ChainFile),
		"PVCLI_CERT_FILE=" + filepath.Join(m.c.certs, m.leaked+".crt"), "PVCLI_KEY_FILE=" + filepath.Join(m.c.certs, m.leaked+".key")}
}

// reissue issues every agent's server and client certificate again, valid
// for validity (0: the default).
func (m *matrix) reissue(t *testing.T, validity time.Duration) {
	t.Helper()
	for _, n := range m.c.nodes {
		if _, err := identity.Issue(m.c.certs, identity.LeafRequest{Kind: identity.KindServer, Name: n.name + "-server",
			DNS: []string{"localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Validity: validity, Force: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := identity.Issue(m.c.certs, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-" + n.name,
			Validity: validity, Force: true}); err != nil {
			t.Fatal(err)
		}
	}
}

// serial is the serial number of the first certificate in file.
func (m *matrix) serial(t *testing.T, file string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	certs, err := identity.ParseCertificates(b)
	if err != nil || len(certs) == 0 {
		t.Fatalf("%s: %v", file, err)
	}
	return certs[0].SerialNumber.Text(16)
}

// presented is the serial of the certificate addr presents.
func presented(t *testing.T, cfg *tls.Config, addr string) string {
	t.Helper()
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", addr, cfg)
	if err != nil {
		return err.Error()
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].SerialNumber.Text(16)
}

// reload changes every agent's log level in its file and has it read the
// file again.
func (m *matrix) reload(t *testing.T) {
	t.Helper()
	for _, n := range m.c.nodes {
		b, err := os.ReadFile(n.config)
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		if strings.Contains(s, "  level: info\n") {
			s = strings.Replace(s, "  level: info\n", "  level: debug\n", 1)
		} else {
			s = strings.Replace(s, "  level: debug\n", "  level: info\n", 1)
		}
		if err := os.WriteFile(n.config, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		m.postReload(t, n)
	}
}

// setting changes the cluster setting logging.level (debug, then info,
// then debug, …) through a random agent.
func (m *matrix) setting(t *testing.T) {
	t.Helper()
	m.level = map[string]string{"": "debug", "debug": "info", "info": "debug"}[m.level]
	m.c.eventually(t, 60*time.Second, "config set logging.level "+m.level, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := m.api[mrand.IntN(len(m.api))].SetConfig(ctx, connect.NewRequest(&clusterv1.SetConfigRequest{Key: "logging.level", Value: m.level}))
		if err != nil {
			return err
		}
		m.levelRev = resp.Msg.GetEntry().GetRevision()
		return nil
	})
}

// readyConfig matches the config check of /ready.
var readyConfig = regexp.MustCompile(`"config":"ok: cluster settings of revision (\d+) applied \(([^)]*)\)"`)

// settingApplied checks that every restarted agent applies the setting,
// at its revision or later, and logs at that level.
func (m *matrix) settingApplied(t *testing.T) {
	t.Helper()
	for _, n := range m.c.nodes {
		m.c.eventually(t, 30*time.Second, n.name+" applies logging.level "+m.level, func() error {
			resp, err := http.Get("http://" + n.metrics + "/ready")
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			var b strings.Builder
			if _, err := io.Copy(&b, resp.Body); err != nil {
				return err
			}
			g := readyConfig.FindStringSubmatch(b.String())
			if g == nil {
				return fmt.Errorf("/ready: %s", b.String())
			}
			if rev, _ := strconv.ParseUint(g[1], 10, 64); rev < m.levelRev || !strings.Contains(g[2], "logging.level") {
				return fmt.Errorf("/ready: settings of revision %s (%s), want logging.level at revision %d or later", g[1], g[2], m.levelRev)
			}
			return nil
		})
	}
}

func (m *matrix) postReload(t *testing.T, n *node) {
	t.Helper()
	resp, err := http.Post("http://"+n.metrics+"/reload", "application/json", nil)
	if err != nil {
		t.Fatalf("POST /reload on %s: %v", n.name, err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("POST /reload on %s: %s", n.name, resp.Status)
	}
}

// leaveRejoin has a follower leave the cluster (it shuts down), starts it
// again and waits until it is a voter again.
func (m *matrix) leaveRejoin(t *testing.T) {
	t.Helper()
	f := m.follower(t)
	m.c.ok(t, f, "cluster", "leave")
	select {
	case <-f.proc.done:
	case <-time.After(30 * time.Second):
		t.Fatalf("%s still running 30s after cluster leave", f.name)
	}
	if code := f.proc.cmd.ProcessState.ExitCode(); code != 0 {
		t.Errorf("%s after cluster leave: %s, want exit status 0", f.name, f.proc.state())
	}
	f.proc = nil
	m.c.restart(t, f)
	m.waitVoters(t)
}

// removePeer removes a follower from the Raft configuration through the
// leader; the reconciler adds it back (it is alive) and promotes it.
func (m *matrix) removePeer(t *testing.T) {
	t.Helper()
	l := m.leader(t)
	f := m.follower(t)
	id, err := os.ReadFile(filepath.Join(f.dataDir, identity.NodeIDFile))
	if err != nil {
		t.Fatal(err)
	}
	m.c.ok(t, l, "cluster", "remove-peer", strings.TrimSpace(string(id)))
	m.waitVoters(t)
}

// transferLeader hands the leadership to another voter.
func (m *matrix) transferLeader(t *testing.T) {
	t.Helper()
	before := m.waitLeader(t)
	m.c.ok(t, m.c.nodes[mrand.IntN(len(m.c.nodes))], "cluster", "transfer-leader")
	m.c.eventually(t, 30*time.Second, "a new leader", func() error {
		l, err := m.c.agreedLeader(t, m.c.nodes...)
		if err != nil {
			return err
		}
		if l.NodeID == before.NodeID {
			return errors.New("the same leader")
		}
		return nil
	})
}
