package agent

import (
	"encoding/json"
	"errors"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/go-memdb"
	"github.com/prometheus/client_golang/prometheus"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// SettingsFile keeps, in the data dir, the last cluster settings this agent
// applied, so that a restart serves with them before it has caught up.
const SettingsFile = "cluster-settings.json"

// keptSettings is SettingsFile's content.
type keptSettings struct {
	Revision uint64            `json:"revision"`
	Settings map[string]string `json:"settings"`
	// ClusterID is the cluster's cluster.id when they were kept: a data
	// dir moved to another cluster does not hold that one back.
	ClusterID string `json:"cluster_id,omitempty"`
}

// settingsStatus is where this node stands with the cluster settings.
type settingsStatus struct {
	mu sync.Mutex
	// values and revision: the cluster's settings and the config revision
	// they were read at (0: none applied from the cluster yet); applied:
	// the keys of them in force here (not those the file pins).
	values   map[string]string
	revision uint64
	applied  []string
	// failed: the revision that could not be applied, and why.
	failed    uint64
	failedErr error
	// floor: no state older than this revision is applied (the kept
	// settings' revision, also when they did not apply).
	floor uint64
	// clusterID: the cluster the revisions belong to ("" until known).
	clusterID string

	revisionGauge prometheus.Gauge
	failingGauge  prometheus.Gauge
	applyTotal    *prometheus.CounterVec
}

func newSettingsStatus(reg prometheus.Registerer) *settingsStatus {
	s := &settingsStatus{
		revisionGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_config_settings_revision",
			Help: "Config revision of the cluster settings this agent applied.",
		}),
		failingGauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "pivirt_config_settings_failing",
			Help: "1 while the latest cluster settings could not be applied on this agent (it serves with the last good ones).",
		}),
		applyTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_config_settings_apply_total",
			Help: "Changes of the cluster settings this agent applied (result ok) or could not apply (result error).",
		}, []string{"result"}),
	}
	reg.MustRegister(s.revisionGauge, s.failingGauge, s.applyTotal)
	return s
}

// SettingsStatus is this agent's state of the cluster settings.
type SettingsStatus struct {
	// Revision is the config revision of the settings in force.
	Revision uint64
	// Keys are the cluster's settings in force here (not those the file
	// pins).
	Keys []string
	// FailedRevision and Error: the latest settings could not be applied.
	FailedRevision uint64
	Error          string
}

// SettingsStatus reports this agent's state of the cluster settings.
func (a *Agent) SettingsStatus() SettingsStatus {
	s := a.settings
	s.mu.Lock()
	defer s.mu.Unlock()
	st := SettingsStatus{Revision: s.revision, Keys: slices.Clone(s.applied), FailedRevision: s.failed}
	if s.failedErr != nil {
		st.Error = s.failedErr.Error()
	}
	return st
}

// nodeConfigStatus is SettingsStatus for NodeService.ConfigStatus.
func (a *Agent) nodeConfigStatus() *clusterv1.NodeConfigStatus {
	st := a.SettingsStatus()
	return &clusterv1.NodeConfigStatus{Node: a.cfg.NodeName, NodeId: a.nodeID, Revision: st.Revision, Keys: st.Keys, FailedRevision: st.FailedRevision, ApplyError: st.Error,
		Pinned: a.fileCfg.Load().PinnedSettings}
}

// loadSettings puts the kept cluster settings on top of the file before
// anything is built from the configuration: a restarted agent serves with
// the settings it last applied (the replicated state may take a while to
// catch up, or never without a quorum).
func (a *Agent) loadSettings() error {
	a.fileCfg.Store(a.cfg)
	path := filepath.Join(a.dataDir, SettingsFile)
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	var kept keptSettings
	if err == nil {
		err = json.Unmarshal(b, &kept)
	}
	if err != nil {
		a.logger.Error("the kept cluster settings do not load; starting with the file's values until the agent catches up", "path", path, "error", err)
		return nil
	}
	a.settings.clusterID = kept.ClusterID
	next, applied, err := config.ApplySettings(a.cfg, kept.Settings)
	var np *netpolicy.Set
	if err == nil {
		np, err = a.settingsNetPolicy(a.cfg, kept.Settings)
	}
	if err != nil {
		a.logger.Error("the kept cluster settings do not apply to this configuration; starting with the file's values until the agent catches up", "path", path, "revision", kept.Revision, "error", err)
		a.settings.fail(kept.Revision, err)
		a.settings.floor = kept.Revision // nothing older is applied
		return nil
	}
	a.cfg = next
	a.clusterNetPolicy.Store(np)
	if np != nil {
		a.clusterNetPolicyDoc = kept.Settings[NetworkPolicyKey]
	}
	if a.opts.Levels != nil {
		level, comps, err := next.Logging.SlogLevels()
		if err != nil {
			return err
		}
		a.opts.Levels.SetLevel(level)
		a.opts.Levels.SetComponents(comps)
	}
	if np != nil {
		applied = append(applied, NetworkPolicyKey)
	}
	a.settings.ok(kept.Revision, kept.Settings, applied)
	a.logger.Info("cluster settings in force from the data dir until the agent catches up", "revision", kept.Revision, "settings", applied)
	return nil
}

func (s *settingsStatus) ok(revision uint64, values map[string]string, applied []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.values, s.revision, s.failed, s.failedErr = values, revision, 0, nil
	s.applied = slices.Sorted(slices.Values(applied))
	s.floor = max(s.floor, revision)
	s.revisionGauge.Set(float64(revision))
	s.failingGauge.Set(0)
}

func (s *settingsStatus) fail(revision uint64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failed, s.failedErr = revision, err
	s.failingGauge.Set(1)
}

// runSettings applies the cluster settings of the replicated state on top
// of the file's configuration, now and after every change of the config
// table, until the agent stops. A set that does not apply here leaves the
// settings in force as they were, and is reported (SettingsStatus, /ready,
// pivirt_config_settings_failing) until a later change applies.
func (a *Agent) runSettings() error {
	a.wg.Go(func() {
		for a.ctx.Err() == nil {
			ws := memdb.NewWatchSet()
			index, entries, err := a.fsm.State().ConfigEntries(ws)
			if err != nil {
				a.logger.Error("reading the cluster settings failed; retrying", "error", err)
				if !sleepCtx(a.ctx, time.Second) {
					return
				}
				continue
			}
			values := map[string]string{}
			for _, e := range entries {
				if s, _, ok, err := config.LookupSetting(e.GetKey()); err == nil && ok && (!s.Document || e.GetKey() == NetworkPolicyKey) {
					values[e.GetKey()] = e.GetValue()
				}
			}
			a.syncSettings(index, values)
			ws.Add(a.settingsKick)
			if err := ws.WatchCtx(a.ctx); err != nil {
				return
			}
		}
	})
	return nil
}

// syncSettings applies values (read at config revision index) unless they
// are what is in force.
func (a *Agent) syncSettings(index uint64, values map[string]string) {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	s := a.settings
	clusterID := ""
	if e, err := a.fsm.State().ConfigEntry(gateway.ClusterIDKey); err == nil {
		clusterID = e.GetValue()
	}
	s.mu.Lock()
	if s.clusterID != "" && clusterID != "" && s.clusterID != clusterID {
		// Kept in another cluster: its revisions mean nothing here.
		a.logger.Warn("the kept cluster settings are another cluster's; following this cluster's", "kept_cluster_id", s.clusterID, "cluster_id", clusterID)
		s.revision, s.floor = 0, 0
	}
	if clusterID != "" {
		s.clusterID = clusterID
	}
	same := maps.Equal(s.values, values) && s.failedErr == nil
	// A restarted node's state starts behind the settings it kept (Raft
	// applies the log past the last snapshot once it hears from a leader):
	// it never goes back to them.
	behind := index < s.revision || index < s.floor
	if same && !behind && index > s.revision {
		// The settings in force are those of this revision too (a write
		// that left them as they were, a document key, a kv/ key): say
		// so, for whoever waits for a revision to be in force.
		s.revision = index
		s.revisionGauge.Set(float64(index))
	}
	s.mu.Unlock()
	if same || behind {
		return
	}
	file := a.fileCfg.Load()
	next, keys, err := config.ApplySettings(file, values)
	var np *netpolicy.Set
	if err == nil {
		np, err = a.settingsNetPolicy(file, values)
	}
	var restart, notLive []string
	if err == nil {
		_, restart, err = a.applyConfig(next)
	}
	if err == nil {
		// A setting applyConfig could not put in force on this node
		// (among the keys needing a restart: rate_limiting or
		// auth.certificate_roles with access control off, logging.*
		// without settable levels) changed nothing: it is not reported
		// applied.
		keys = slices.DeleteFunc(keys, func(k string) bool {
			if slices.ContainsFunc(restart, func(r string) bool { return config.Under(r, k) || config.Under(k, r) }) {
				notLive = append(notLive, k)
				return true
			}
			return false
		})
		a.setClusterNetPolicy(values[NetworkPolicyKey], np)
		if np != nil {
			keys = append(keys, NetworkPolicyKey)
		}
	}
	if err != nil {
		s.mu.Lock()
		repeated := s.failed == index
		s.mu.Unlock()
		s.fail(index, err)
		if !repeated {
			s.applyTotal.WithLabelValues("error").Inc()
			a.logger.Error("cluster settings not applied on this node; serving with the last good ones until a change applies", "revision", index, "error", err)
		}
		return
	}
	if len(notLive) > 0 {
		a.logger.Warn("cluster settings not in force on this node: they do not change live here", "revision", index, "settings", notLive)
	}
	s.ok(index, values, keys)
	s.applyTotal.WithLabelValues("ok").Inc()
	a.logger.Info("cluster settings applied", "revision", index, "settings", keys)
	s.mu.Lock()
	kept := keptSettings{Revision: index, Settings: values, ClusterID: s.clusterID}
	s.mu.Unlock()
	b, err := json.Marshal(kept)
	if err == nil {
		err = identity.WriteFileAtomic(filepath.Join(a.dataDir, SettingsFile), b, 0o600)
	}
	if err != nil {
		a.logger.Error("keeping a copy of the cluster settings failed", "error", err)
	}
}

// settingsNetPolicy is the cluster's network policy of values, parsed; nil
// when none is set or the file pins auth.network_policy.
func (a *Agent) settingsNetPolicy(file *config.Config, values map[string]string) (*netpolicy.Set, error) {
	doc, ok := values[NetworkPolicyKey]
	if !ok || file.Pinned(NetworkPolicyKey) {
		return nil, nil
	}
	if !file.TLS.Enabled {
		return nil, &config.SettingError{Key: NetworkPolicyKey, Err: errors.New("network policies match the names of TLS certificates; this node runs with tls.enabled false")}
	}
	p, err := netpolicy.Parse(strings.NewReader(doc))
	if err != nil {
		return nil, &config.SettingError{Key: NetworkPolicyKey, Err: err}
	}
	return p, nil
}

// setClusterNetPolicy puts the cluster's network policy (p, parsed from
// doc; nil: the file's applies again) in force when its text changed, and
// enforces it on the open connections at once. reloadMu is held.
func (a *Agent) setClusterNetPolicy(doc string, p *netpolicy.Set) {
	if p == nil {
		doc = ""
	}
	if doc == a.clusterNetPolicyDoc && (p == nil) == (a.clusterNetPolicy.Load() == nil) {
		return
	}
	a.clusterNetPolicyDoc = doc
	old := a.clusterNetPolicy.Swap(p)
	if a.netPolicyChanged == nil {
		return
	}
	if old == nil || p == nil {
		a.logger.Info("network policy in force", "source", map[bool]string{true: "cluster", false: "file"}[p != nil])
	}
	select {
	case a.netPolicyChanged <- struct{}{}:
	default:
	}
}
