package config

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"

	"gopkg.in/yaml.v3"
)

var typeOfConfig = reflect.TypeFor[Config]()

// Cluster settings are the keys of the replicated configuration that every
// agent applies on top of its file: a subset of the file's keys that can
// change live. The value of a setting is the YAML (or JSON) text of that
// key as it would appear in the file; it is decoded by the same strict
// walker and checked by the same Validate as the file, so a setting and a
// file entry cannot mean different things.

// FreeFormPrefix is the prefix of replicated config keys that no agent
// interprets: applications' own documents.
const FreeFormPrefix = "kv/"

// Setting describes one cluster setting.
type Setting struct {
	// Key is the setting's key; "<name>" stands for a backend's name.
	Key string
	// Doc says what it changes.
	Doc string
	// Document: the value is a document of its own (an RBAC policy), not
	// a YAML value of the configuration; its checks are the caller's.
	Document bool
	// set copies the setting from src (a configuration holding the decoded
	// value) into dst.
	set func(dst, src *Config, name string) error
}

// Settings are the cluster settings, in the order the reference lists them.
var Settings = []Setting{
	{Key: "logging.level", Doc: "the agents' log level", set: func(d, s *Config, _ string) error { d.Logging.Level = s.Logging.Level; return nil }},
	{Key: "logging.components", Doc: "levels of their own for components of the agents (`{raft: warn, access: debug}`)", set: func(d, s *Config, _ string) error {
		d.Logging.Components = maps.Clone(s.Logging.Components)
		return nil
	}},
	{Key: "routing.rules", Doc: "which backend serves which API (method prefixes); replaces the file's rules, or the default routes", set: func(d, s *Config, _ string) error {
		d.Routing.Rules = slices.Clone(s.Routing.Rules)
		return nil
	}},
	{Key: "load_balancing", Doc: "the backends' load-balancing policy and health checks", set: func(d, s *Config, _ string) error { d.LoadBalancing = s.LoadBalancing; return nil }},
	{Key: "circuit_breaking", Doc: "outlier ejection of failing backend endpoints", set: func(d, s *Config, _ string) error { d.CircuitBreaking = s.CircuitBreaking; return nil }},
	{Key: "rate_limiting", Doc: "per-caller request rates on the API port", set: func(d, s *Config, _ string) error {
		d.RateLimiting = s.RateLimiting
		d.RateLimiting.Routes = slices.Clone(s.RateLimiting.Routes)
		return nil
	}},
	{Key: "backends.<name>.timeout", Doc: "a backend's per-try timeout, on every node that has the backend", set: func(d, s *Config, name string) error {
		return setBackend(d, name, func(b *BackendConfig) { b.Timeout = s.Backends[name].Timeout })
	}},
	{Key: "backends.<name>.retry", Doc: "a backend's retry policy, on every node that has the backend", set: func(d, s *Config, name string) error {
		return setBackend(d, name, func(b *BackendConfig) { b.Retry = s.Backends[name].Retry })
	}},
	{Key: "auth.certificate_roles", Doc: "the roles of callers authenticated by a client certificate, by CN or CN prefix", set: func(d, s *Config, _ string) error {
		d.Auth.CertificateRoles = maps.Clone(s.Auth.CertificateRoles)
		return nil
	}},
	{Key: "auth.rbac_policy", Doc: "the RBAC policy (the text of an rbac.yaml), enforced by every agent in place of its auth.rbac_policy file", Document: true},
	{Key: "auth.network_policy", Doc: "the network policies (the text of NetworkPolicy documents), enforced by every agent in place of its auth.network_policy file, on new and open connections", Document: true},
}

// reservedPrefixes are the keys (and key prefixes) that belong to the
// configuration: a replicated key under one of them must be a setting.
var reservedPrefixes = func() []string {
	var out []string
	for _, f := range fieldsOf(typeOfConfig) {
		out = append(out, f.name)
	}
	return out
}()

func setBackend(d *Config, name string, f func(*BackendConfig)) error {
	b, ok := d.Backends[name]
	if !ok {
		return fmt.Errorf("%w: backend %q is not configured on this node (backends: %s)", ErrInvalid, name, strings.Join(slices.Sorted(maps.Keys(d.Backends)), ", "))
	}
	f(&b)
	d.Backends = maps.Clone(d.Backends)
	d.Backends[name] = b
	return nil
}

// LookupSetting finds the setting of a replicated config key: the setting
// and, for backends.<name>.*, the name. ok is false for a free-form key
// (FreeFormPrefix) and for keys the configuration does not own; err names
// what is wrong with a key under a configuration prefix that is no
// setting.
func LookupSetting(key string) (s Setting, name string, ok bool, err error) {
	if strings.HasPrefix(key, FreeFormPrefix) {
		return Setting{}, "", false, nil
	}
	for _, st := range Settings {
		if n, match := matchSetting(st.Key, key); match {
			return st, n, true, nil
		}
	}
	for _, p := range reservedPrefixes {
		if Under(key, p) {
			return Setting{}, "", false, &FieldError{Path: key, Err: fmt.Errorf("%w: not a cluster setting (a key of each node's file, set there); cluster settings: %s; free-form keys go under %q",
				ErrUnknownKey, strings.Join(SettingKeys(), ", "), FreeFormPrefix)}
		}
	}
	return Setting{}, "", false, &FieldError{Path: key, Err: fmt.Errorf("%w: cluster settings: %s; free-form keys go under %q (%s%s)",
		ErrUnknownKey, strings.Join(SettingKeys(), ", "), FreeFormPrefix, FreeFormPrefix, key)}
}

// SettingKeys are the settings' keys.
func SettingKeys() []string {
	out := make([]string, len(Settings))
	for i, s := range Settings {
		out[i] = s.Key
	}
	return out
}

// matchSetting matches key against a setting's pattern; name is what
// "<name>" stood for.
func matchSetting(pattern, key string) (name string, ok bool) {
	before, after, wild := strings.Cut(pattern, "<name>")
	if !wild {
		return "", key == pattern
	}
	if !strings.HasPrefix(key, before) || !strings.HasSuffix(key, after) || len(key) <= len(before)+len(after) {
		return "", false
	}
	name = key[len(before) : len(key)-len(after)]
	if checkName(name) != nil {
		return "", false
	}
	return name, true
}

// ParseSetting decodes and checks the value of the setting at key, on its
// own: its YAML types, keys and enumerations, and the checks of Validate
// that concern only it (a route naming a backend is checked where it is
// applied, since nodes differ in their backends). It returns a
// configuration of the defaults holding the value, for ApplySettings.
func ParseSetting(key, value string) (*Config, error) {
	s, name, ok, err := LookupSetting(key)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, nil
	}
	if s.Document {
		return nil, nil
	}
	var node yaml.Node
	if err := yaml.Unmarshal([]byte(value), &node); err != nil {
		return nil, &FieldError{Path: key, Err: fmt.Errorf("%w: not YAML or JSON: %w", ErrType, err)}
	}
	if node.Kind != yaml.DocumentNode || len(node.Content) != 1 {
		return nil, &FieldError{Path: key, Err: fmt.Errorf("%w: empty value (delete the key to go back to each node's file)", ErrInvalid)}
	}
	// The value goes where the key names it: {backends: {pivirtd: {retry: VALUE}}}.
	root := node.Content[0]
	parts := strings.Split(s.Key, ".")
	for i := len(parts) - 1; i >= 0; i-- {
		k := parts[i]
		if k == "<name>" {
			k = name
		}
		root = &yaml.Node{Kind: yaml.MappingNode, Tag: "!!map", Content: []*yaml.Node{{Kind: yaml.ScalarNode, Tag: strTag, Value: k}, root}}
	}
	doc, err := yaml.Marshal(root)
	if err != nil {
		return nil, &FieldError{Path: key, Err: err}
	}
	cfg := Default()
	cfg.Backends = nil
	if err := decodeYAML(doc, "", cfg); err != nil {
		return nil, err
	}
	v := &validator{setting: true}
	cfg.validateAll(v)
	var errs []error
	for _, e := range v.errs {
		var fe *FieldError
		if errors.As(e, &fe) && Under(fe.Path, key) {
			errs = append(errs, e)
		}
	}
	return cfg, errors.Join(errs...)
}

// Pinned reports whether the file keeps key to itself (pinned_settings).
func (c *Config) Pinned(key string) bool {
	for _, p := range c.PinnedSettings {
		if _, ok := matchSetting(p, key); ok || p == key {
			return true
		}
	}
	return false
}

// SettingError is a setting that could not be applied on this node.
type SettingError struct {
	Key string
	Err error
}

func (e *SettingError) Error() string { return e.Key + ": " + e.Err.Error() }
func (e *SettingError) Unwrap() error { return e.Err }

// ApplySettings returns file with the cluster settings (key → value) on
// top, except those the file pins, and the keys it applied. Keys that are
// no setting (free-form, or documents such as auth.rbac_policy) are
// skipped. Any setting that does not decode or apply here, or a result
// that does not Validate, is an error naming the key, and the result is
// nil: a node applies the cluster's settings whole or keeps what it has.
// With nothing applied, the result is file as it is.
func ApplySettings(file *Config, settings map[string]string) (*Config, []string, error) {
	out := *file
	var applied []string
	var errs []error
	for _, key := range slices.Sorted(maps.Keys(settings)) {
		s, name, ok, err := LookupSetting(key)
		if err != nil || !ok || s.Document {
			continue // refused at write; an older agent's key is left alone
		}
		if file.Pinned(key) {
			continue
		}
		src, err := ParseSetting(key, settings[key])
		if err == nil {
			err = s.set(&out, src, name)
		}
		if err != nil {
			errs = append(errs, &SettingError{Key: key, Err: err})
			continue
		}
		applied = append(applied, key)
	}
	if len(errs) == 0 && len(applied) > 0 {
		if err := out.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return nil, nil, errors.Join(errs...)
	}
	return &out, applied, nil
}
