package agent

import (
	"errors"
	"log/slog"
	"maps"
	"slices"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/netpolicy"
	"pilab.hu/pivirt-agent/gateway/watchfile"
)

// Check is what the agent refuses of a configuration before it starts
// anything: its keys and values (config.Validate), then the files it names,
// each loaded by the function the start loads it with — the key files'
// modes, the gossip key, the RBAC and network policy files, the agent's
// certificates (tls, server.connectrpc.tls, tls.cluster_ca), the backends'
// and etcd's TLS files, the routes' descriptor sets. pivirt-agent validate
// runs it, and Start runs it first: a file validate accepts is not refused
// at start for what it holds. Every problem is returned, each naming its
// key.
func Check(cfg *config.Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	quiet := slog.New(slog.DiscardHandler)
	var errs []error
	add := func(err error) {
		if err != nil {
			errs = append(errs, err)
		}
	}
	add(checkKeyPermissions(cfg, quiet))
	if f := cfg.Cluster.Gossip.EncryptKeyFile; f != "" {
		_, err := readGossipKey(f)
		add(err)
	}
	if p := cfg.Auth.RBACPolicy; p != "" {
		_, err := authz.LoadFile(p, policyResources(), nil)
		add(err)
	}
	if p := cfg.Auth.NetworkPolicy; p != "" {
		_, err := watchfile.Load("auth.network_policy", p, netpolicy.Parse, nil)
		add(err)
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Backends)) {
		if bt := cfg.Backends[name].TLS; bt.Enabled {
			_, err := backendSource(cfg, name, bt, quiet)
			add(err)
		}
	}
	if cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
		_, _, err := etcdTLS(cfg, quiet)
		add(err)
	}
	rules, _ := cfg.EffectiveRoutes()
	for i, r := range rules {
		_, err := routeSchema(i, r)
		add(err)
	}
	if cfg.TLS.Enabled && !cfg.Dev {
		t, err := loadTLS(cfg, quiet)
		add(err)
		if err == nil {
			add(checkClusterCAFiles(cfg, t.client))
		}
	}
	return errors.Join(errs...)
}
