package agent

import (
	"fmt"
	"log/slog"
	"slices"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/mesh"
)

// ReloadConfig applies a new configuration (validated) to the running
// agent: the keys that can change live are applied — logging.level,
// routing.rules, backends, load_balancing and circuit_breaking (new
// backend clusters replace the old, which finish their calls in flight),
// and rate_limiting — and every other
// changed key is returned as needing a restart. Nothing is applied when
// something live cannot be (a route to a backend that does not run): the
// error names the key.
func (a *Agent) ReloadConfig(next *config.Config) (applied, restart []string, err error) {
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	cur := a.current.Load()
	merged := *cur
	var (
		level    *slog.Level
		routes   []mesh.Route
		limits   *access.Limits
		backends []*mesh.Backend
		rebuild  bool
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
		case k == "logging.level" && a.opts.LogLevel != nil:
			var l slog.Level
			if err := l.UnmarshalText([]byte(next.Logging.Level)); err != nil {
				return nil, nil, fmt.Errorf("logging.level: %w", err)
			}
			level = &l
			merged.Logging.Level = next.Logging.Level
		case config.Under(k, "routing.rules") && !a.cfg.Dev:
			if routes == nil {
				if routes, err = a.buildRoutes(effectiveRules(next)); err != nil {
					return nil, nil, err
				}
				merged.Routing = next.Routing
			}
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
		a.opts.LogLevel.Set(*level)
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
		routes = append(routes, mesh.Route{Prefix: r.Match.Prefix, Backend: b})
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
