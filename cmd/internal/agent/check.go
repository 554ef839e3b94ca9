package agent

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/authz"
	"pilab.hu/pivirt-agent/gateway/mesh"
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
	add(checkLogOutput(cfg.Logging.Output))
	if f := cfg.Cluster.Gossip.EncryptKeyFile; f != "" {
		_, err := readGossipKey(f)
		add(err)
	}
	// The routes' descriptor sets, whose annotations name resources a
	// policy may name.
	var schemas []*mesh.Schema
	rules, _ := cfg.EffectiveRoutes()
	for i, r := range rules {
		s, err := routeSchema(i, r)
		add(err)
		if s != nil {
			schemas = append(schemas, s)
		}
	}
	if p := cfg.Auth.RBACPolicy; p != "" {
		_, err := authz.LoadFile(p, policyResources(schemas), nil)
		add(err)
	}
	if p := cfg.Auth.NetworkPolicy; p != "" {
		_, err := watchfile.Load("auth.network_policy", p, netpolicy.Parse, nil)
		add(err)
	}
	for _, name := range slices.Sorted(maps.Keys(cfg.Backends)) {
		bt := cfg.Backends[name].TLS
		if !bt.Enabled || usesAgentFiles(cfg, bt) {
			// The agent's own files are loadTLS's (below), or, in dev
			// mode, the PKI the start makes.
			continue
		}
		_, err := backendSource(cfg, name, bt, quiet)
		add(err)
	}
	if cfg.ServiceDiscovery.Type == config.DiscoveryEtcd {
		_, _, err := etcdTLS(cfg, quiet)
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

// usesAgentFiles reports whether a backend's TLS takes the agent's own
// certificate and CA files (those the tls block gives, or --dev makes):
// the start then uses the agent's source for it.
func usesAgentFiles(cfg *config.Config, bt config.BackendTLSConfig) bool {
	if cfg.Dev {
		return bt.CertFile == "" || bt.CAFile == ""
	}
	return cfg.TLS.Enabled && (bt.CertFile == "" || bt.CertFile == cfg.TLS.CertFile) &&
		(bt.KeyFile == "" || bt.KeyFile == cfg.TLS.KeyFile) && (bt.CAFile == "" || bt.CAFile == cfg.TLS.CAFile)
}

// checkLogOutput refuses a logging.output file the agent could not open
// for writing: its directory missing or not writable, or the file itself
// not writable. Nothing is created.
func checkLogOutput(path string) error {
	switch path {
	case "", "stdout", "stderr":
		return nil
	}
	if st, err := os.Stat(path); err == nil {
		if st.IsDir() {
			return fmt.Errorf("logging.output: %s is a directory; name a file in it", path)
		}
		if err := unix.Access(path, unix.W_OK); err != nil {
			return fmt.Errorf("logging.output: %s is not writable: %w", path, err)
		}
		return nil
	}
	dir := filepath.Dir(path)
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("logging.output: the directory of %s: %w", path, err)
	}
	if !st.IsDir() {
		return fmt.Errorf("logging.output: %s is not a directory", dir)
	}
	if err := unix.Access(dir, unix.W_OK); err != nil {
		return fmt.Errorf("logging.output: the file %s cannot be made in %s: %w", filepath.Base(path), dir, err)
	}
	return nil
}
