package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/gateway"
	"pilab.hu/pivirt-agent/identity"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/store"
	"pilab.hu/pivirt-agent/store/etcdstore"
)

// etcdMode reports whether the state lives in etcd
// (service_discovery.type: etcd) instead of the embedded Raft group.
func (a *Agent) etcdMode() bool { return a.etcd != nil }

// openEtcd connects to the etcd of service_discovery.etcd and opens the
// etcd-backed store on a.fsm. An etcd that does not answer yet is not an
// error: the agent starts not ready and follows etcd once it answers.
func (a *Agent) openEtcd(ctx context.Context) error {
	ec := a.cfg.ServiceDiscovery.Etcd
	ccfg := clientv3.Config{
		Endpoints: ec.Endpoints,
		// No DialTimeout: the dial does not block, so an agent starts while
		// etcd is down.
		DialKeepAliveTime:    10 * time.Second,
		DialKeepAliveTimeout: 5 * time.Second,
		Logger:               zap.NewNop(),
	}
	// Each TLS handshake gets the configuration for the endpoint's host
	// (see etcdstore.Conns.DialOptions).
	tlsFor, src, err := etcdTLS(a.cfg, a.logger)
	if err != nil {
		return err
	}
	if src != nil {
		src.SetRevocation(a.revocation)
		a.wg.Go(func() { src.Watch(a.ctx, tlsWatchInterval) })
	}
	conns := new(etcdstore.Conns)
	// The dial options' credentials are the ones used, over those etcd's
	// client picks from an endpoint's scheme.
	ccfg.DialOptions = conns.DialOptions(tlsFor)
	cli, err := clientv3.New(ccfg)
	if err != nil {
		return fmt.Errorf("service_discovery.etcd: %w", err)
	}
	a.etcdClient = cli
	a.etcd, err = etcdstore.Open(ctx, etcdstore.Config{
		Client:       cli,
		Prefix:       ec.Prefix,
		NodeID:       a.nodeID,
		FSM:          a.fsm,
		DedupeWindow: fsm.DefaultConfig().DedupeWindow,
		SessionTTL:   a.opts.EtcdSessionTTL,
		Conns:        conns,
		Logger:       a.logger,
	})
	if err != nil {
		return fmt.Errorf("service_discovery.etcd: %w", err)
	}
	a.logger.Info("the cluster state is kept in etcd", "endpoints", ec.Endpoints, "prefix", ec.Prefix)
	return nil
}

// etcdTLS is the TLS configuration towards etcd of cfg
// (service_discovery.etcd), per server name; nil: plaintext. With a
// ca_file, src is the certificate source to watch. Each file is read first,
// so that every missing or unreadable one is named (at start and by
// pivirt-agent validate, through Check).
func etcdTLS(cfg *config.Config, logger *slog.Logger) (tlsFor func(serverName string) *tls.Config, src *identity.Source, err error) {
	ec := cfg.ServiceDiscovery.Etcd
	var unreadable []error
	for _, f := range [][2]string{
		{"service_discovery.etcd.ca_file", ec.CAFile},
		{"service_discovery.etcd.cert_file", ec.CertFile},
		{"service_discovery.etcd.key_file", ec.KeyFile},
	} {
		if f[1] != "" {
			if _, err := os.ReadFile(f[1]); err != nil {
				unreadable = append(unreadable, fmt.Errorf("%s: %w", f[0], err))
			}
		}
	}
	if len(unreadable) > 0 {
		return nil, nil, errors.Join(unreadable...)
	}
	switch {
	case ec.CAFile != "":
		src, err := identity.NewSource(identity.SourceConfig{CertFile: ec.CertFile, KeyFile: ec.KeyFile, CAFile: ec.CAFile, Logger: logger})
		if err != nil {
			return nil, nil, fmt.Errorf("service_discovery.etcd: %w", err)
		}
		return src.ClientConfig, src, nil
	case ec.CertFile != "":
		// etcd's certificate verified against the system's roots.
		cert, err := tls.LoadX509KeyPair(ec.CertFile, ec.KeyFile)
		if err != nil {
			return nil, nil, fmt.Errorf("service_discovery.etcd.cert_file: %w", err)
		}
		return func(serverName string) *tls.Config {
			return &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName, Certificates: []tls.Certificate{cert}}
		}, nil, nil
	case ec.TLS():
		return func(serverName string) *tls.Config {
			return &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
		}, nil, nil
	}
	return nil, nil, nil
}

// etcdAdapter presents the etcd-backed store through the interfaces gateway
// and cluster declare, as raftAdapter does for Raft. Every agent reads and
// writes etcd itself (gateway.ClusterServiceConfig.Direct); the "leader"
// it reports is the holder of the schedule leadership.
type etcdAdapter struct {
	s         *etcdstore.Store
	nodeID    string
	name      string
	applyTime prometheus.Observer
	tracer    trace.Tracer
	members   *cluster.Gossip
}

var (
	_ gateway.Consensus    = etcdAdapter{}
	_ gateway.RaftAdmin    = etcdAdapter{}
	_ cluster.StatusSource = etcdAdapter{}
)

func (e etcdAdapter) Apply(ctx context.Context, cmd []byte) (any, uint64, error) {
	return observeApply(ctx, e.tracer, e.applyTime, cmd, e.s.Apply)
}

// Leader names the schedule leader and its internal address.
func (e etcdAdapter) Leader() (string, string) {
	id := e.s.LeaderID()
	if id == "" {
		return "", ""
	}
	if m, ok := e.members.MemberByID(id); ok {
		return id, m.Meta.InternalAddr
	}
	return id, ""
}

func (e etcdAdapter) ReadIndex(ctx context.Context) (uint64, error) { return e.s.ReadIndex(ctx) }

// RaftStatus describes the etcd mirror in Raft's terms: the state is
// "etcd", the indexes are the etcd revision the mirror applied, and the
// last contact is etcd's last answer (stale reads with max_stale use it).
func (e etcdAdapter) RaftStatus() gateway.RaftStatus {
	st := e.s.Status()
	return gateway.RaftStatus{
		State:        "etcd",
		LastIndex:    st.Revision,
		CommitIndex:  st.Revision,
		AppliedIndex: st.Revision,
		LastContact:  st.LastContact,
		LeaderID:     st.LeaderID,
	}
}

func errNoRaft(what string) error {
	return fmt.Errorf("%w: %s: this cluster keeps its state in etcd (service_discovery.type etcd); there is no Raft group", store.ErrUnsupported, what)
}

func (e etcdAdapter) Servers(context.Context) ([]cluster.RaftServer, error) {
	return nil, errNoRaft("raft peers")
}

func (e etcdAdapter) RemoveServer(context.Context, string) error {
	return errNoRaft("remove a raft peer")
}

// TransferLeadership hands the schedule leadership over: this node resigns
// and the next agent in the election takes it. A target cannot be chosen.
func (e etcdAdapter) TransferLeadership(ctx context.Context, id string) (string, error) {
	if id != "" && id != e.nodeID {
		return "", fmt.Errorf("%w: in etcd mode the schedule leadership goes to the next agent in the election; a target cannot be chosen", store.ErrUnsupported)
	}
	if err := e.s.Resign(ctx); err != nil {
		return "", err
	}
	// The next candidate takes over at once; with none, this node wins
	// again.
	deadline := time.Now().Add(5 * time.Second)
	for {
		switch l := e.s.LeaderID(); {
		case l != "" && l != e.nodeID:
			return l, nil
		case l == e.nodeID && time.Now().After(deadline):
			return "", fmt.Errorf("%w: no other agent campaigns for the schedule leadership; it stays here", store.ErrUnsupported)
		}
		t := time.NewTimer(20 * time.Millisecond)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", ctx.Err()
		case <-t.C:
		}
	}
}

func (e etcdAdapter) NodeStatus() *nodev1.StatusResponse {
	st := e.s.Status()
	var contact time.Duration
	if !st.LastContact.IsZero() {
		contact = time.Since(st.LastContact)
	}
	return &nodev1.StatusResponse{
		NodeId:       e.nodeID,
		Name:         e.name,
		RaftState:    "etcd",
		LastIndex:    st.Revision,
		CommitIndex:  st.Revision,
		AppliedIndex: st.Revision,
		LastContact:  durationpb.New(contact),
		HasState:     st.Synced,
		LeaderId:     st.LeaderID,
	}
}

// etcdNotReady is the error of a request refused while the mirror does not
// follow etcd.
func (a *Agent) etcdNotReady() error {
	st := a.etcd.Status()
	if st.LastError != "" {
		return fmt.Errorf("%w: %s", store.ErrUnavailable, st.LastError)
	}
	return fmt.Errorf("%w: the state is not loaded from etcd yet", store.ErrUnavailable)
}
