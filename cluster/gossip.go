package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log"
	"log/slog"
	"net"
	"os"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
)

// MemberStatus is a member's state as seen through gossip.
type MemberStatus int

// Member states. Failed means the failure detector declared the member dead;
// Left means it announced a graceful leave.
const (
	StatusAlive MemberStatus = iota + 1
	StatusSuspect
	StatusFailed
	StatusLeft
)

func (s MemberStatus) String() string {
	switch s {
	case StatusAlive:
		return "alive"
	case StatusSuspect:
		return "suspect"
	case StatusFailed:
		return "failed"
	case StatusLeft:
		return "left"
	}
	return "unknown"
}

// Member is one node of the gossip ring.
type Member struct {
	Name   string
	Addr   string // gossip address host:port
	Status MemberStatus
	Meta   NodeMeta
	// Since is when the member entered Status (as observed locally).
	Since time.Time
	// Changed is when Status, Addr or the agent's start time (Meta.Started)
	// last changed, as observed locally: a restart that came back before
	// the member was declared failed changes its start time, not its
	// Status. (Other metadata a member may change at will.)
	Changed time.Time
}

// GossipConfig configures the memberlist ring.
type GossipConfig struct {
	NodeName      string
	BindAddr      string // host:port
	AdvertiseAddr string // host:port; empty = derived by memberlist
	Meta          NodeMeta
	Logger        *slog.Logger
	// Profile selects memberlist timing: "lan" (default) or "local" (fast
	// failure detection, for tests and single-host clusters).
	Profile string
	// DeadNodeReclaimTime lets a node that restarted on a new address take
	// its name back once the old incarnation has been dead this long.
	DeadNodeReclaimTime time.Duration
	// ForgetAfter drops failed and left members from the member list.
	ForgetAfter time.Duration
	// ForgetUnprovenAfter drops sooner the failed and left members that
	// never proved their identity (SetProven): a process that had the
	// gossip key alone and is gone leaves no trace for ForgetAfter.
	ForgetUnprovenAfter time.Duration
	// SecretKey enables gossip encryption (16, 24 or 32 bytes) on the first
	// start; KeyringFile, once it exists, holds the keyring instead (keys
	// installed and used since), so it survives restarts.
	SecretKey   []byte
	KeyringFile string
	// PeersFile, when set, is where the addresses of known members are
	// saved (every reconnect round and at shutdown), so that a restarted
	// node can rejoin without join flags. A graceful Leave deletes it.
	PeersFile string
	// ReconnectInterval is how often failed members are contacted again, so
	// that a ring split by a long partition heals (memberlist alone only
	// gossips to the dead for a short while).
	ReconnectInterval time.Duration
	// PushPullInterval overrides the profile's full state exchange period
	// (memberlist's; 0 keeps the profile's, 30 s on lan).
	PushPullInterval time.Duration
}

// DefaultGossipConfig returns the production defaults.
func DefaultGossipConfig() GossipConfig {
	return GossipConfig{
		BindAddr:            "0.0.0.0:7946",
		Profile:             "lan",
		DeadNodeReclaimTime: 10 * time.Second,
		ForgetAfter:         72 * time.Hour,
		ForgetUnprovenAfter: 10 * time.Minute,
		ReconnectInterval:   30 * time.Second,
	}
}

// Validate checks the configuration.
func (c GossipConfig) Validate() error {
	var errs []error
	if c.NodeName == "" {
		errs = append(errs, errors.New("gossip: node name is required"))
	}
	if _, _, err := splitHostPort(c.BindAddr); err != nil {
		errs = append(errs, fmt.Errorf("gossip: bind address: %w", err))
	}
	if c.AdvertiseAddr != "" {
		if _, _, err := splitHostPort(c.AdvertiseAddr); err != nil {
			errs = append(errs, fmt.Errorf("gossip: advertise address: %w", err))
		}
	}
	if c.Profile != "lan" && c.Profile != "local" {
		errs = append(errs, fmt.Errorf("gossip: profile %q: want lan or local", c.Profile))
	}
	if c.Meta.ID == "" {
		errs = append(errs, errors.New("gossip: node meta needs the node id"))
	}
	if c.Meta.Cluster == "" {
		errs = append(errs, errors.New("gossip: node meta needs the cluster name"))
	}
	return errors.Join(errs...)
}

// Gossip is the memberlist ring with a locally tracked view of members,
// including failed and left ones, which memberlist itself forgets.
type Gossip struct {
	cfg    GossipConfig
	logger *slog.Logger
	ml     *memberlist.Memberlist

	// keyring is memberlist's (nil without encryption); keyringMu
	// serialises changes and the writes of keyringFile.
	keyring     *memberlist.Keyring
	keyringMu   sync.Mutex
	keyringFile string

	mu      sync.Mutex
	members map[string]*Member
	// forced are the members a force-leave named while this node still saw
	// them alive: their failure, when it comes, is taken as a leave (true:
	// and the member forgotten, force-leave --prune).
	forced map[string]bool
	subs   map[chan struct{}]struct{}
	meta   []byte
	// proven tells a member that proved its identity (SetProven).
	proven func(Member) bool

	stopReap chan struct{}
	reapDone chan struct{}
	// savedPeers is what savePeers last wrote (reapLoop's only).
	savedPeers []byte

	// selfAddr is this node's gossip address, set once memberlist runs.
	// staleSelf is set by a join exchange in which the other side still
	// knows this node's name at another address: the node restarted on a
	// new address and that member keeps the old incarnation (alive,
	// suspect, or dead for less than DeadNodeReclaimTime), so it ignored
	// the new one. memberlist offers the new address again only at its
	// next periodic push/pull (30 s on lan, longer in big rings); reapLoop
	// offers it every rejoinInterval (every ReconnectInterval once past any
	// reclaim) until no exchange reports the old address. rejoining and its
	// times are reapLoop's only.
	selfAddr     atomic.Pointer[string]
	staleSelf    atomic.Bool
	rejoining    bool
	rejoinSince  time.Time
	rejoinWarned time.Time
	rejoinLast   time.Time

	// closeMu serialises Leave and Shutdown: memberlist panics on a
	// Leave after Shutdown.
	closeMu sync.Mutex
	closed  bool
	left    bool
}

// ErrGossipClosed is returned by Leave and Join after Shutdown.
var ErrGossipClosed = errors.New("gossip is shut down")

// NewGossip starts the gossip listener. It does not join anyone.
func NewGossip(cfg GossipConfig) (*Gossip, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	meta, err := cfg.Meta.encode()
	if err != nil {
		return nil, err
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	g := &Gossip{
		cfg:      cfg,
		logger:   logger.With("component", "gossip"),
		members:  make(map[string]*Member),
		subs:     make(map[chan struct{}]struct{}),
		meta:     meta,
		stopReap: make(chan struct{}),
		reapDone: make(chan struct{}),
	}

	var mc *memberlist.Config
	if cfg.Profile == "local" {
		mc = memberlist.DefaultLocalConfig()
	} else {
		mc = memberlist.DefaultLANConfig()
	}
	mc.Name = cfg.NodeName
	host, port, _ := splitHostPort(cfg.BindAddr)
	mc.BindAddr = host
	mc.BindPort = port
	if cfg.AdvertiseAddr != "" {
		ah, ap, _ := splitHostPort(cfg.AdvertiseAddr)
		mc.AdvertiseAddr = ah
		mc.AdvertisePort = ap
	} else if port != 0 {
		mc.AdvertisePort = port
	}
	mc.Delegate = (*gossipDelegate)(g)
	mc.Events = (*gossipEvents)(g)
	mc.Alive = (*gossipGuard)(g)
	mc.Merge = (*gossipGuard)(g)
	mc.DeadNodeReclaimTime = cfg.DeadNodeReclaimTime
	if cfg.PushPullInterval > 0 {
		mc.PushPullInterval = cfg.PushPullInterval
	}
	mc.Logger = log.New(&slogWriter{logger: g.logger}, "", 0)
	keys := [][]byte(nil)
	if len(cfg.SecretKey) > 0 {
		keys = [][]byte{cfg.SecretKey}
	}
	if cfg.KeyringFile != "" {
		saved, ok, err := loadKeyring(cfg.KeyringFile)
		if err != nil {
			return nil, err
		}
		if ok {
			if len(keys) > 0 && !slices.ContainsFunc(saved, func(k []byte) bool { return bytes.Equal(k, keys[0]) }) {
				g.logger.Warn("the gossip key of cluster.gossip.encrypt_key_file is not in the saved keyring; using the keyring",
					"keyring", cfg.KeyringFile)
			}
			keys = saved
		}
	}
	if len(keys) > 0 {
		kr, err := memberlist.NewKeyring(keys, keys[0])
		if err != nil {
			return nil, fmt.Errorf("gossip keyring: %w", err)
		}
		mc.Keyring = kr
		g.keyring = kr
		g.keyringFile = cfg.KeyringFile
		if cfg.KeyringFile != "" {
			if err := saveKeyring(cfg.KeyringFile, kr); err != nil {
				return nil, fmt.Errorf("gossip keyring: %w", err)
			}
		}
	}
	ml, err := memberlist.Create(mc)
	if err != nil {
		return nil, fmt.Errorf("start gossip on %s: %w", cfg.BindAddr, err)
	}
	g.ml = ml
	self := g.LocalAddr()
	g.selfAddr.Store(&self)
	go g.reapLoop()
	return g, nil
}

// LocalAddr is the address other members use to gossip with this node.
func (g *Gossip) LocalAddr() string {
	n := g.ml.LocalNode()
	return net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port)))
}

// Join contacts the given gossip addresses; it succeeds if any answers.
func (g *Gossip) Join(addrs []string) (int, error) {
	n, err := g.ml.Join(addrs)
	if n > 0 {
		g.logger.Info("joined gossip ring", "contacted", n, "addrs", addrs)
		return n, nil
	}
	if err == nil {
		err = errors.New("no address answered")
	}
	return 0, fmt.Errorf("join %v: %w", addrs, err)
}

// Leave announces a graceful departure and waits up to timeout for it to
// spread: first a meta update marking this node as leaving, then
// memberlist's leave message.
func (g *Gossip) Leave(timeout time.Duration) error {
	g.closeMu.Lock()
	defer g.closeMu.Unlock()
	if g.closed {
		return ErrGossipClosed
	}
	g.mu.Lock()
	meta := g.cfg.Meta
	meta.Leaving = true
	b, err := meta.encode()
	if err == nil {
		g.meta = b
	}
	g.mu.Unlock()
	if err == nil {
		if err := g.ml.UpdateNode(timeout / 2); err != nil {
			g.logger.Warn("announce leave intent", "error", err)
		}
	}
	g.left = true
	if g.cfg.PeersFile != "" {
		if err := os.Remove(g.cfg.PeersFile); err != nil && !errors.Is(err, fs.ErrNotExist) {
			g.logger.Warn("remove known gossip peers", "error", err)
		}
	}
	if err := g.ml.Leave(timeout / 2); err != nil {
		return fmt.Errorf("leave gossip ring: %w", err)
	}
	return nil
}

// Shutdown stops gossiping without announcing a leave.
func (g *Gossip) Shutdown() error {
	g.closeMu.Lock()
	defer g.closeMu.Unlock()
	if g.closed {
		return nil
	}
	g.closed = true
	close(g.stopReap)
	<-g.reapDone
	if !g.left {
		g.savePeers()
	}
	if err := g.ml.Shutdown(); err != nil {
		return fmt.Errorf("shutdown gossip: %w", err)
	}
	return nil
}

// Members returns every known member, sorted by name. (memberlist does not
// expose its suspect state, so a suspect member is reported alive until it
// is declared failed.)
func (g *Gossip) Members() []Member {
	g.mu.Lock()
	out := make([]Member, 0, len(g.members))
	for _, m := range g.members {
		out = append(out, *m)
	}
	g.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// ErrNoSuchMember is ForceLeave's error for a name no member has.
var ErrNoSuchMember = errors.New("no such gossip member")

// ForceLeave marks the failed member name as left, as if it had left
// gracefully: it is forgotten after ForgetAfter, and the leader removes
// its Raft server. A member this node still sees alive (its failure
// detection lags the node that asked) is marked left when it fails here;
// pending reports that. memberlist keeps its own view: should the node
// come back, its alive message makes it a member again.
//
// With prune the member is also forgotten at once (not kept as left until
// ForgetAfter), once it is left here.
func (g *Gossip) ForceLeave(name string, prune bool) (pending bool, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	m, ok := g.members[name]
	switch {
	case !ok:
		return false, fmt.Errorf("%w %q", ErrNoSuchMember, name)
	case m.Status == StatusLeft:
		if prune {
			delete(g.members, name)
			g.logger.Info("gossip member forgotten", "member", name)
			g.notifyLocked()
		}
		return false, nil
	case m.Status != StatusFailed:
		if g.forced == nil {
			g.forced = make(map[string]bool)
		}
		// true: forget it too once it fails (prune).
		g.forced[name] = g.forced[name] || prune
		g.logger.Info("gossip member to be taken as left once it fails here", "member", name, "status", m.Status.String())
		return true, nil
	}
	m.Status, m.Since, m.Changed = StatusLeft, time.Now(), time.Now()
	g.logger.Info("gossip member forced to leave", "member", name)
	if prune {
		delete(g.members, name)
		g.logger.Info("gossip member forgotten", "member", name)
	}
	g.notifyLocked()
	return false, nil
}

// MemberByID returns the member whose meta carries the node ID.
func (g *Gossip) MemberByID(id string) (Member, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var best *Member
	for _, m := range g.members {
		if m.Meta.ID != id {
			continue
		}
		// Prefer a live entry when a renamed node left an old one behind.
		if best == nil || (best.Status != StatusAlive && m.Status == StatusAlive) {
			best = m
		}
	}
	if best == nil {
		return Member{}, false
	}
	return *best, true
}

// ServerByID returns the member that speaks for the server node id whose
// Raft address is raftAddr (the Raft configuration's): of the members
// claiming id, an alive one gossiping raftAddr first, then any alive one,
// then any; among equals, the one in its state longest. A member claiming a
// server's ID at another address cannot draw the calls meant for that
// server while it is alive. One that copies the address as well can make
// some of them fail, not receive them: calls verify the server
// certificate of the internal address they dial (cluster/DESIGN.md,
// "Admission").
func (g *Gossip) ServerByID(id, raftAddr string) (Member, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	var best *Member
	rank := func(m *Member) int {
		switch {
		case m.Status == StatusAlive && raftAddr != "" && m.Meta.RaftAddr == raftAddr:
			return 2
		case m.Status == StatusAlive:
			return 1
		}
		return 0
	}
	for _, m := range g.members {
		if m.Meta.ID != id {
			continue
		}
		if best == nil || rank(m) > rank(best) || (rank(m) == rank(best) && m.Since.Before(best.Since)) {
			best = m
		}
	}
	if best == nil {
		return Member{}, false
	}
	return *best, true
}

// Subscribe returns a channel that receives a value (coalesced) after every
// membership change, and a function to stop the subscription.
func (g *Gossip) Subscribe() (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	g.mu.Lock()
	g.subs[ch] = struct{}{}
	g.mu.Unlock()
	return ch, func() {
		g.mu.Lock()
		delete(g.subs, ch)
		g.mu.Unlock()
	}
}

func (g *Gossip) notifyLocked() {
	for ch := range g.subs {
		select {
		case ch <- struct{}{}:
		default:
		}
	}
}

func (g *Gossip) upsert(n *memberlist.Node, status MemberStatus) {
	meta, err := decodeMeta(n.Meta)
	if err != nil {
		g.logger.Warn("ignoring gossip member with unreadable meta", "member", n.Name, "error", err)
		return
	}
	addr := net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port)))
	g.mu.Lock()
	defer g.mu.Unlock()
	m, ok := g.members[n.Name]
	if !ok {
		m = &Member{Name: n.Name}
		g.members[n.Name] = m
	}
	switch {
	case status == StatusAlive:
		delete(g.forced, n.Name) // back: a member again
	case status == StatusFailed:
		if prune, forced := g.forced[n.Name]; forced {
			delete(g.forced, n.Name)
			if prune {
				delete(g.members, n.Name)
				g.logger.Info("gossip member forgotten as it failed (force-leave --prune)", "member", n.Name)
				g.notifyLocked()
				return
			}
			status = StatusLeft
		}
	}
	now := time.Now()
	if m.Status != status {
		m.Since = now
	}
	if m.Status != status || m.Addr != addr || m.Meta.Started != meta.Started {
		m.Changed = now
	}
	m.Addr, m.Status, m.Meta = addr, status, meta
	g.notifyLocked()
}

func (g *Gossip) reapLoop() {
	defer close(g.reapDone)
	interval := g.reconnectInterval()
	t := time.NewTicker(interval)
	defer t.Stop()
	rejoin := time.NewTicker(min(interval, rejoinInterval))
	defer rejoin.Stop()
	for {
		select {
		case <-g.stopReap:
			return
		case <-t.C:
			g.reap(time.Now())
			g.reconnect()
			g.savePeers()
		case <-rejoin.C:
			g.offerNewAddress()
		}
	}
}

// reconnectInterval is ReconnectInterval, 30 s if unset.
func (g *Gossip) reconnectInterval() time.Duration {
	if g.cfg.ReconnectInterval <= 0 {
		return 30 * time.Second
	}
	return g.cfg.ReconnectInterval
}

// rejoinInterval is how often a node that restarted on a new address offers
// it to members that still hold the old one (see Gossip.staleSelf).
const rejoinInterval = 2 * time.Second

// offerNewAddress runs a join exchange with some alive members while the
// last ones reported this node at an old address. An exchange carries this
// node's state, which a member takes once the old incarnation has been dead
// for DeadNodeReclaimTime; the exchange's answer sets staleSelf again if
// that member still holds the old address.
func (g *Gossip) offerNewAddress() {
	if !g.staleSelf.Load() {
		if g.rejoining {
			g.rejoining = false
			g.logger.Info("gossip members know this node at its new address", "addr", g.LocalAddr())
		}
		return
	}
	now := time.Now()
	// Past any reclaim (the old incarnation is declared dead within
	// seconds, then DeadNodeReclaimTime), the old address is most likely
	// another live node using this node's name: offer at the reconnect
	// pace from then on, and say so once a minute.
	overdue := g.cfg.DeadNodeReclaimTime + time.Minute
	switch {
	case !g.rejoining:
		g.rejoining, g.rejoinSince, g.rejoinWarned = true, now, now
		g.logger.Info("gossip members still know this node at an old address; offering the new one until they take it",
			"addr", g.LocalAddr(), "reclaim_after", g.cfg.DeadNodeReclaimTime)
	case now.Sub(g.rejoinSince) < overdue:
	case now.Sub(g.rejoinLast) < g.reconnectInterval():
		return
	case now.Sub(g.rejoinWarned) >= time.Minute:
		g.rejoinWarned = now
		g.logger.Warn("gossip members still know this node's name at another address; is another node running with the same node_name?",
			"addr", g.LocalAddr(), "since", now.Sub(g.rejoinSince).Round(time.Second))
	}
	g.rejoinLast = now
	g.staleSelf.Store(false)
	self := g.LocalAddr()
	answered := g.joinSome(func(m *Member) bool {
		return m.Status == StatusAlive && m.Addr != self && m.Name != g.cfg.NodeName
	})
	if len(answered) == 0 {
		// Nobody confirmed the new address: offer it again.
		g.staleSelf.Store(true)
	}
}

// savePeers records the gossip addresses of the other members that are not
// known to have left.
func (g *Gossip) savePeers() {
	if g.cfg.PeersFile == "" {
		return
	}
	self := g.LocalAddr()
	g.mu.Lock()
	var addrs []string
	for _, m := range g.members {
		if m.Status != StatusLeft && m.Addr != self {
			addrs = append(addrs, m.Addr)
		}
	}
	g.mu.Unlock()
	sort.Strings(addrs)
	if len(addrs) == 0 {
		return
	}
	b, err := json.Marshal(addrs)
	if err != nil || bytes.Equal(b, g.savedPeers) {
		return
	}
	if err := writeFileAtomic(g.cfg.PeersFile, b); err != nil {
		g.logger.Warn("save known gossip peers", "file", g.cfg.PeersFile, "error", err)
		return
	}
	g.savedPeers = b
}

// LoadPeers returns the gossip addresses saved in a PeersFile; a missing
// file yields none.
func LoadPeers(path string) ([]string, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read known gossip peers: %w", err)
	}
	var addrs []string
	if err := json.Unmarshal(b, &addrs); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return addrs, nil
}

func writeFileAtomic(path string, data []byte) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// maxReconnectsPerRound bounds the work of one reconnect round.
const maxReconnectsPerRound = 8

// reconnect contacts failed (not left) members again, as Serf does: after a
// partition longer than memberlist's gossip-to-the-dead window the two
// halves of the ring would otherwise never merge again.
func (g *Gossip) reconnect() {
	for _, a := range g.joinSome(func(m *Member) bool { return m.Status == StatusFailed }) {
		g.logger.Info("reconnected to failed member", "addr", a)
	}
}

// joinSome runs a join exchange with each of up to maxReconnectsPerRound
// members that pick selects, one at a time, until Shutdown; it returns the
// addresses that answered.
func (g *Gossip) joinSome(pick func(*Member) bool) []string {
	g.mu.Lock()
	var addrs []string
	for _, m := range g.members {
		if len(addrs) == maxReconnectsPerRound {
			break
		}
		if pick(m) {
			addrs = append(addrs, m.Addr)
		}
	}
	g.mu.Unlock()
	var answered []string
	for _, a := range addrs {
		select {
		case <-g.stopReap:
			return answered
		default:
		}
		if n, err := g.ml.Join([]string{a}); err == nil && n > 0 {
			answered = append(answered, a)
		}
	}
	return answered
}

// SetProven sets what tells a member that proved its identity (the
// agent's admission, or its place in the Raft configuration): a failed or
// left member that did not is forgotten after ForgetUnprovenAfter.
func (g *Gossip) SetProven(proven func(Member) bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.proven = proven
}

func (g *Gossip) reap(now time.Time) {
	if g.cfg.ForgetAfter <= 0 {
		return
	}
	g.mu.Lock()
	var unproven []Member
	for name, m := range g.members {
		if m.Status != StatusFailed && m.Status != StatusLeft {
			continue
		}
		switch gone := now.Sub(m.Since); {
		case gone > g.cfg.ForgetAfter:
			delete(g.members, name)
		case g.proven != nil && g.cfg.ForgetUnprovenAfter > 0 && gone > g.cfg.ForgetUnprovenAfter:
			unproven = append(unproven, *m)
		}
	}
	proven := g.proven
	g.mu.Unlock()
	// Asked without the lock: the answer may take a Raft configuration
	// read.
	var forget []Member
	for _, m := range unproven {
		if !proven(m) {
			forget = append(forget, m)
		}
	}
	if len(forget) == 0 {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, m := range forget {
		if cur, ok := g.members[m.Name]; ok && cur.Status == m.Status && cur.Since.Equal(m.Since) {
			g.logger.Info("forgetting a member that never proved its identity", "name", m.Name, "status", m.Status.String(), "since", m.Since, "addr", m.Addr)
			delete(g.members, m.Name)
		}
	}
}

// gossipDelegate serves this node's meta. No user messages are exchanged.
type gossipDelegate Gossip

func (d *gossipDelegate) NodeMeta(limit int) []byte {
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.meta) > limit {
		return nil
	}
	return d.meta
}
func (d *gossipDelegate) NotifyMsg([]byte)                           {}
func (d *gossipDelegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *gossipDelegate) LocalState(join bool) []byte                { return nil }
func (d *gossipDelegate) MergeRemoteState(buf []byte, join bool)     {}

// gossipGuard refuses members of another cluster, both when a single node
// announces itself and when two rings would merge.
type gossipGuard Gossip

func (gg *gossipGuard) check(n *memberlist.Node) error {
	meta, err := decodeMeta(n.Meta)
	if err != nil {
		return fmt.Errorf("member %s: %w", n.Name, err)
	}
	if meta.Cluster != gg.cfg.Meta.Cluster {
		return fmt.Errorf("member %s belongs to cluster %q, not %q", n.Name, meta.Cluster, gg.cfg.Meta.Cluster)
	}
	return nil
}

func (gg *gossipGuard) NotifyAlive(n *memberlist.Node) error {
	if err := gg.check(n); err != nil {
		gg.logger.Warn("refusing gossip member", "error", err)
		return err
	}
	return nil
}

func (gg *gossipGuard) NotifyMerge(peers []*memberlist.Node) error {
	self := gg.selfAddr.Load()
	for _, n := range peers {
		if err := gg.check(n); err != nil {
			gg.logger.Warn("refusing to merge with another gossip ring", "error", err)
			return err
		}
		if self != nil && n.Name == gg.cfg.NodeName && n.State != memberlist.StateLeft &&
			net.JoinHostPort(n.Addr.String(), strconv.Itoa(int(n.Port))) != *self {
			gg.staleSelf.Store(true)
		}
	}
	return nil
}

// gossipEvents tracks membership. memberlist calls it synchronously, so it
// only updates the map and signals subscribers without blocking.
type gossipEvents Gossip

func (e *gossipEvents) NotifyJoin(n *memberlist.Node) {
	(*Gossip)(e).upsert(n, StatusAlive)
}

func (e *gossipEvents) NotifyUpdate(n *memberlist.Node) {
	(*Gossip)(e).upsert(n, StatusAlive)
}

func (e *gossipEvents) NotifyLeave(n *memberlist.Node) {
	st := StatusFailed
	// memberlist does not fill in n.State, so a graceful leave is recognised
	// by the leave intent the node gossiped in its meta just before.
	if meta, err := decodeMeta(n.Meta); n.State == memberlist.StateLeft || (err == nil && meta.Leaving) {
		st = StatusLeft
	}
	g := (*Gossip)(e)
	g.logger.Info("gossip member gone", "member", n.Name, "status", st.String())
	g.upsert(n, st)
}

func splitHostPort(addr string) (string, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return "", 0, fmt.Errorf("port %q out of range 0-65535", portStr)
	}
	return host, port, nil
}

// slogWriter adapts memberlist's "[LEVEL] memberlist: msg" log lines to
// slog. The peer's address (memberlist's trailing "from=host:port") goes to
// the attribute "from", and the message keeps only the event: what varies
// between occurrences — quoted text (often the sender's own: a label, a
// node name), addresses, numbers — is replaced by "…", the line as it was
// kept in the attribute "text". Log sampling (logging.sampling) keys on the
// message, so 50,000 junk packets from as many source ports are a handful
// of lines, not one each.
type slogWriter struct {
	logger *slog.Logger
}

var (
	// fromAddr is memberlist.LogAddress's suffix, at the end of the line
	// (text before it may come from the sender: a label, a node name).
	fromAddr = regexp.MustCompile(`\s*from=(\S*)$`)
	// variable are the parts of a line that differ between occurrences of
	// the same event: quoted text (often the sender's), addresses,
	// numbers.
	variable = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'[^']*'|(?:\d{1,3}(?:\.\d{1,3}){3}|\[[0-9A-Fa-f:.%]+\]):\d{1,5}|\b(?:0x)?[0-9A-Fa-f]*\d[0-9A-Fa-f]*\b`)
	// elided is a run of replaced parts (a byte dump such as a node's
	// meta), which the message shows as one.
	elided = regexp.MustCompile(`…(?:[\s,]*…)+`)
)

func (w *slogWriter) Write(p []byte) (int, error) {
	line := bytes.TrimSpace(p)
	level := slog.LevelInfo
	for _, l := range []struct {
		tag   string
		level slog.Level
	}{{"[DEBUG]", slog.LevelDebug}, {"[TRACE]", slog.LevelDebug}, {"[INFO]", slog.LevelInfo}, {"[WARN]", slog.LevelWarn}, {"[ERR]", slog.LevelError}, {"[ERROR]", slog.LevelError}} {
		if bytes.HasPrefix(line, []byte(l.tag)) {
			level = l.level
			line = bytes.TrimSpace(line[len(l.tag):])
			break
		}
	}
	line = bytes.TrimPrefix(line, []byte("memberlist: "))
	text := string(line)
	var attrs []any
	if m := fromAddr.FindStringSubmatchIndex(text); m != nil {
		attrs = append(attrs, "from", text[m[2]:m[3]])
		text = text[:m[0]]
	}
	// The message is the event; what varies goes to "text" whole.
	msg := elided.ReplaceAllString(variable.ReplaceAllString(text, "…"), "…")
	if msg != text {
		attrs = append(attrs, "text", text)
	}
	w.logger.Log(context.Background(), level, strings.TrimSpace(msg), attrs...)
	return len(p), nil
}

var _ io.Writer = (*slogWriter)(nil)
