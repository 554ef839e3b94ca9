package agent

import (
	"fmt"
	"log/slog"
	"slices"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/mesh"
)

// ReloadConfig applies a new configuration file (validated) to the running
// agent, with the cluster settings in force on top of it (except those it
// pins): the keys that can change live are applied — logging.level,
// routing.rules, backends, load_balancing and circuit_breaking (new
// backend clusters replace the old, which finish their calls in flight),
// rate_limiting, auth.certificate_roles and tls.revocation — and every other changed key is
// returned as needing a restart. Nothing is applied when something live
// cannot be (a route to a backend that does not run, a cluster setting
// that does not apply to the new file): the error names the key.
func (a *Agent) ReloadConfig(file *config.Config) (applied, restart []string, err error) {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	a.settings.mu.Lock()
	values := a.settings.values
	a.settings.mu.Unlock()
	next, _, err := config.ApplySettings(file, values)
	if err == nil {
		_, err = a.settingsNetPolicy(file, values)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("the cluster settings in force do not apply to this file: %w", err)
	}
	if applied, restart, err = a.applyConfig(next); err != nil {
		return nil, nil, err
	}
	a.fileCfg.Store(file)
	// The file may pin or unpin auth.network_policy.
	np, _ := a.settingsNetPolicy(file, values)
	a.setClusterNetPolicy(values[NetworkPolicyKey], np)
	// A change of the cluster settings that failed may apply to this file.
	select {
	case a.settingsKick <- struct{}{}:
	default:
	}
	// The services directory is read again on every reload.
	select {
	case a.servicesKick <- struct{}{}:
	default:
	}
	return applied, restart, nil
}

// applyConfig puts next (a file with the cluster settings on top) in force
// where it differs from the configuration in force; reloadMu is held.
func (a *Agent) applyConfig(next *config.Config) (applied, restart []string, err error) {
	cur := a.current.Load()
	merged := *cur
	var (
		level    *slog.Level
		routes   []mesh.Route
		limits   *access.Limits
		backends []*mesh.Backend
		rebuild  bool
		// certRoles: auth.certificate_roles changed.
		certRoles  bool
		revocation bool
		components map[string]slog.Level
	)
	changed := config.Diff(cur, next)
	for _, k := range changed {
		if !a.cfg.Dev && (config.Under(k, "backends") || config.Under(k, "load_balancing") || config.Under(k, "circuit_breaking")) {
			rebuild = true
		}
	}
	if rebuild {
		// New backend clusters (and routes to them), built before anything
		// changes: a failure leaves everything as it was.
		var err error
		if backends, routes, err = a.buildBackends(next); err != nil {
			return nil, nil, err
		}
		merged.Backends, merged.LoadBalancing, merged.CircuitBreaking, merged.Routing = next.Backends, next.LoadBalancing, next.CircuitBreaking, next.Routing
	}
	for _, k := range changed {
		switch {
		case rebuild && (config.Under(k, "backends") || config.Under(k, "load_balancing") || config.Under(k, "circuit_breaking") || config.Under(k, "routing.rules")):
		case (k == "logging.level" || config.Under(k, "logging.components")) && a.opts.Levels != nil:
			if level == nil {
				l, comps, err := next.Logging.SlogLevels()
				if err != nil {
					return nil, nil, err
				}
				level, components = &l, comps
				merged.Logging.Level, merged.Logging.Components = next.Logging.Level, next.Logging.Components
			}
		case config.Under(k, "routing.rules") && !a.cfg.Dev:
			if routes == nil {
				if routes, err = a.buildRoutes(effectiveRules(next)); err != nil {
					return nil, nil, err
				}
				merged.Routing = next.Routing
			}
		case k == "service_discovery.services_dir":
			// Read again by the services directory's loop (ReloadConfig).
			merged.ServiceDiscovery.ServicesDir = next.ServiceDiscovery.ServicesDir
		case config.Under(k, "server.ui"):
			// Read per request by the UI's handler (uiConfig).
			merged.Server.UI = next.Server.UI
		case k == "pinned_settings":
			// Taken into account by ApplySettings, which made next.
			merged.PinnedSettings = next.PinnedSettings
		case config.Under(k, "auth.certificate_roles") && a.authn != nil:
			certRoles = true
			merged.Auth.CertificateRoles = next.Auth.CertificateRoles
		case config.Under(k, "tls.revocation") && a.revocation != nil:
			revocation = true
			merged.TLS.Revocation = next.TLS.Revocation
		case config.Under(k, "rate_limiting") && a.guard != nil:
			if limits == nil {
				l := rateLimits(next.RateLimiting)
				limits = &l
				merged.RateLimiting = next.RateLimiting
			}
		default:
			restart = append(restart, k)
			continue
		}
		applied = append(applied, k)
	}
	// The only step that can fail first, so that a refusal changes nothing.
	if limits != nil {
		if err := a.guard.SetLimits(*limits); err != nil {
			for _, b := range backends {
				_ = b.Close()
			}
			return nil, nil, fmt.Errorf("rate_limiting: %w", err)
		}
	}
	if level != nil {
		a.opts.Levels.SetLevel(*level)
		a.opts.Levels.SetComponents(components)
	}
	if certRoles {
		a.authn.SetCertRoles(next.Auth.CertificateRoles)
	}
	if revocation {
		// Validated with the file: the mode and policy are known values.
		if err := a.revocation.SetConfig(a.revocationConfig(next.TLS.Revocation)); err != nil {
			a.logger.Error("tls.revocation not applied", "error", err)
		}
	}
	switch {
	case rebuild:
		a.replaceBackends(backends, routes)
	case routes != nil:
		a.setRoutes(routes)
	}
	a.current.Store(&merged)
	slices.Sort(applied)
	if len(applied) > 0 || len(restart) > 0 {
		a.logger.Info("configuration reloaded", "applied", applied, "restart_required", restart)
	}
	return applied, restart, nil
}

// buildRoutes makes the proxy's routes of rules, to the running backends.
func (a *Agent) buildRoutes(rules []config.RouteRule) ([]mesh.Route, error) {
	backends := a.currentBackends()
	byName := make(map[string]*mesh.Backend, len(backends))
	for _, b := range backends {
		byName[b.Name()] = b
	}
	routes := make([]mesh.Route, 0, len(rules))
	for i, r := range rules {
		b, ok := byName[r.Route.Cluster]
		if !ok {
			return nil, fmt.Errorf("routing.rules[%d].route.cluster: %q is not a running backend (a new backend needs a restart)", i, r.Route.Cluster)
		}
		route, err := a.newRoute(i, r, b)
		if err != nil {
			return nil, err
		}
		routes = append(routes, route)
	}
	return routes, nil
}

// rateLimits is the guard's form of rate_limiting.
func rateLimits(rl config.RateLimitingConfig) access.Limits {
	var l access.Limits
	if rl.Enabled {
		l.Default = access.Limit{PerSecond: rl.RequestsPerSecond, Burst: rl.Burst}
		for _, r := range rl.Routes {
			l.Routes = append(l.Routes, access.RouteLimit{Prefix: r.Prefix, Limit: access.Limit{PerSecond: r.RequestsPerSecond, Burst: r.Burst}})
		}
	}
	return l
}

// effectiveRules are cfg's routing rules in force (the defaults without a
// routing block).
func effectiveRules(cfg *config.Config) []config.RouteRule {
	rules, _ := cfg.EffectiveRoutes()
	return rules
}
