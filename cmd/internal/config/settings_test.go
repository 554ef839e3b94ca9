package config

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestParseSetting(t *testing.T) {
	for _, tc := range []struct {
		key, value string
		err        string // "" = valid
	}{
		{"logging.level", "debug", ""},
		{"logging.level", `"warn"`, ""},
		{"logging.level", "verbose", `logging.level: invalid value "verbose" (allowed: debug, info, warn, error)`},
		{"logging.level", "", "logging.level: invalid value: empty value"},
		{"logging.lvl", "debug", `logging.lvl: unknown key: not a cluster setting`},
		{"log_level", "debug", `log_level: unknown key: cluster settings: logging.level`},
		{"server.connectrpc.addr", "x", `not a cluster setting (a key of each node's file`},
		{"kv/log_level", "anything: [at all", ""},
		{"routing.rules", "- match: {prefix: /pivirt.vm.v1.}\n  route: {cluster: elsewhere}", ""},
		{"routing.rules", `[{"match": {"prefix": "pivirt"}, "route": {"cluster": "pivirtd"}}]`, `routing.rules[0].match.prefix: invalid value "pivirt": must start with "/"`},
		{"routing.rules", "- match: {prefx: /a}", `routing.rules[0].match.prefx: unknown key`},
		{"backends.pivirtd.timeout", "2s", ""},
		{"backends.pivirtd.timeout", "fast", `backends.pivirtd.timeout`},
		{"backends.pivirtd.retry", "{max_attempts: 3, backoff: 100ms}", ""},
		{"backends.pivirtd.retry", "{max_attempts: -1}", "backends.pivirtd.retry.max_attempts: invalid value: must not be negative"},
		{"backends.pivirtd.endpoint", "unix:///x", "not a cluster setting"},
		{"rate_limiting", "{enabled: true, requests_per_second: 0, burst: 1}", "rate_limiting.requests_per_second: invalid value 0: must be positive"},
		{"rate_limiting", "{enabled: true, requests_per_second: 5, burst: 2}", ""},
		{"load_balancing", "{policy: fastest}", `load_balancing.policy: invalid value "fastest"`},
		{"auth.certificate_roles", "{operator: [admin]}", ""},
		{"auth.certificate_roles", "{'*': [admin]}", `auth.certificate_roles["*"]: invalid value`},
		{"auth.certificate_roles", "[admin]", "auth.certificate_roles: wrong type"},
	} {
		t.Run(tc.key+"="+tc.value, func(t *testing.T) {
			_, err := ParseSetting(tc.key, tc.value)
			switch {
			case tc.err == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.err != "" && err == nil:
				t.Fatalf("accepted, want %q", tc.err)
			case tc.err != "" && !strings.Contains(err.Error(), tc.err):
				t.Fatalf("error %q, want it to contain %q", err, tc.err)
			}
		})
	}
}

func TestApplySettings(t *testing.T) {
	file := Default()
	file.Backends = map[string]BackendConfig{"pivirtd": {Endpoint: "unix:///run/pivirtd.sock", Timeout: Duration(5 * time.Second)}}
	file.PinnedSettings = []string{"rate_limiting"}
	got, applied, err := ApplySettings(file, map[string]string{
		"logging.level":            "debug",
		"backends.pivirtd.timeout": "2s",
		"rate_limiting":            "{enabled: true, requests_per_second: 5, burst: 2}",
		"kv/other":                 "x",
		"auth.rbac_policy":         "not yaml of the file",
	})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(applied, ",") != "backends.pivirtd.timeout,logging.level" {
		t.Errorf("applied %v", applied)
	}
	if got.Logging.Level != "debug" || got.Backends["pivirtd"].Timeout.Std() != 2*time.Second || got.RateLimiting.Enabled {
		t.Errorf("got level %s timeout %s rate limiting %v", got.Logging.Level, got.Backends["pivirtd"].Timeout, got.RateLimiting.Enabled)
	}
	if file.Logging.Level != "info" || file.Backends["pivirtd"].Timeout.Std() != 5*time.Second {
		t.Error("the file's configuration changed")
	}

	// A setting that cannot apply here refuses the whole set.
	_, _, err = ApplySettings(file, map[string]string{
		"logging.level":         "debug",
		"backends.osinfo.retry": "{max_attempts: 2}",
		"routing.rules":         "[{match: {prefix: /a.}, route: {cluster: nowhere}}]",
	})
	var se *SettingError
	if !errors.As(err, &se) || se.Key != "backends.osinfo.retry" || !strings.Contains(err.Error(), `backend "osinfo" is not configured on this node`) {
		t.Errorf("err = %v", err)
	}
	_, _, err = ApplySettings(file, map[string]string{"routing.rules": "[{match: {prefix: /a.}, route: {cluster: nowhere}}]"})
	if err == nil || !strings.Contains(err.Error(), `routing.rules[0].route.cluster: invalid value "nowhere": not a backend (backends: pivirtd)`) {
		t.Errorf("err = %v", err)
	}
}

func TestPinnedSettingsValidate(t *testing.T) {
	c := Default()
	c.PinnedSettings = []string{"logging.level", "backends.<name>.retry", "backends.pivirtd.timeout", "logging.format"}
	err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), `pinned_settings[3]: invalid value "logging.format": not a cluster setting`) || strings.Contains(err.Error(), "pinned_settings[0]") || strings.Contains(err.Error(), "pinned_settings[1]") || strings.Contains(err.Error(), "pinned_settings[2]") {
		t.Errorf("err = %v", err)
	}
}

// TestEverySettingIsLive: a cluster setting is applied by every agent while
// it runs (there is no restart to wait for), so each is either a document
// (its text is applied by code of its own in the agent) or a key under one
// of LiveKeys, which the agent's applyConfig puts in force (the agent's
// TestEverySettingAppliesLive checks that side). A setting under none
// would be stored, reported applied and change nothing. Each LiveKeys
// entry names keys of the configuration, and the reference marks every
// setting's keys live.
func TestEverySettingIsLive(t *testing.T) {
	live := func(key string) bool {
		for _, k := range LiveKeys {
			if Under(key, k) {
				return true
			}
		}
		return false
	}
	for _, s := range Settings {
		key := strings.ReplaceAll(s.Key, "<name>", "x")
		switch {
		case s.Document && live(key):
			t.Errorf("setting %s: a document, and also under LiveKeys: one way to apply it, not two", s.Key)
		case !s.Document && !live(key):
			t.Errorf("setting %s: not under any of LiveKeys (%s): no running agent would put it in force; add it there and to the agent's applyConfig", s.Key, strings.Join(LiveKeys, ", "))
		}
	}
	rows := Reference()
	for _, k := range LiveKeys {
		if !slices.ContainsFunc(rows, func(r RefRow) bool { return Under(strings.ReplaceAll(r.Key, "[]", ""), k) }) {
			t.Errorf("LiveKeys names %q, no key of the configuration", k)
		}
	}
	for _, r := range rows {
		if r.Setting && !r.Document && !r.Live {
			t.Errorf("reference: %s is a cluster setting marked restart", r.Key)
		}
	}
}
