package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"github.com/spf13/cobra"
	"gopkg.in/yaml.v3"
)

const (
	envConfig  = "PVCLI_CONFIG"
	envContext = "PVCLI_CONTEXT"
)

// cliConfig is pvcli's configuration file: named contexts, each a cluster
// and the credentials to reach it, as kubectl's and nomad's users expect.
//
//	current_context: prod
//	contexts:
//	  prod:
//	    endpoints: [https://10.0.0.1:8443, https://10.0.0.2:8443]
//	    ca_file: /etc/pivirt/certs/ca-chain.pem
//	    cert_file: ~/.config/pvcli/prod.crt
//	    key_file: ~/.config/pvcli/prod.key
//	    token: ...
type cliConfig struct {
	CurrentContext string                 `yaml:"current_context,omitempty"`
	Contexts       map[string]*cliContext `yaml:"contexts,omitempty"`
}

// cliContext is one context of the configuration file. Flags and
// environment variables override each of its fields.
type cliContext struct {
	Endpoints []string `yaml:"endpoints,omitempty"`
	CAFile    string   `yaml:"ca_file,omitempty"`
	CertFile  string   `yaml:"cert_file,omitempty"`
	KeyFile   string   `yaml:"key_file,omitempty"`
	Token     string   `yaml:"token,omitempty"`
}

// configPath is the configuration file: $PVCLI_CONFIG, else
// $XDG_CONFIG_HOME/pvcli/config.yaml, else ~/.config/pvcli/config.yaml.
// Empty when none can be named (no HOME).
func (a *app) configPath() string {
	if p := a.getenv(envConfig); p != "" {
		return p
	}
	if x := a.getenv("XDG_CONFIG_HOME"); x != "" {
		return filepath.Join(x, "pvcli", "config.yaml")
	}
	if home := a.getenv("HOME"); home != "" {
		return filepath.Join(home, ".config", "pvcli", "config.yaml")
	}
	return ""
}

// loadConfig reads the configuration file; a missing file is an empty
// configuration.
func (a *app) loadConfig() (*cliConfig, string, error) {
	path := a.configPath()
	cfg := &cliConfig{}
	if path == "" {
		return cfg, "", nil
	}
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return cfg, path, nil
	}
	if err != nil {
		return nil, path, usagef("pvcli configuration %s: %v", path, err)
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	if err := dec.Decode(cfg); err != nil && !errors.Is(err, io.EOF) {
		return nil, path, usagef("pvcli configuration %s: %v (keys: current_context, contexts.NAME.{endpoints, ca_file, cert_file, key_file, token})", path, err)
	}
	for name, c := range cfg.Contexts {
		if c == nil {
			cfg.Contexts[name] = &cliContext{}
		}
	}
	if cfg.CurrentContext != "" && cfg.Contexts[cfg.CurrentContext] == nil {
		return nil, path, usagef("pvcli configuration %s: current_context %q is not among its contexts (%s); run pvcli context use NAME",
			path, cfg.CurrentContext, strings.Join(contextNames(cfg), ", "))
	}
	return cfg, path, nil
}

// saveConfig writes cfg to path atomically, 0600: a context may hold a
// token.
func saveConfig(path string, cfg *cliConfig) error {
	if path == "" {
		return usagef("no place for the pvcli configuration: set HOME or %s", envConfig)
	}
	b, err := yaml.Marshal(cfg)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".config-*.yaml")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

func contextNames(cfg *cliConfig) []string {
	names := make([]string, 0, len(cfg.Contexts))
	for n := range cfg.Contexts {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// activeContext is the context in force: --context, else $PVCLI_CONTEXT,
// else the file's current_context; nil when none is.
func (a *app) activeContext(cmd *cobra.Command) (*cliContext, string, error) {
	name, source := a.opts.context, "--context"
	if !cmd.Flags().Changed("context") {
		name, source = a.getenv(envContext), envContext
	}
	cfg, path, err := a.loadConfig()
	if err != nil {
		return nil, "", err
	}
	if name == "" {
		name = cfg.CurrentContext
		if name == "" {
			return nil, "", nil
		}
	}
	c := cfg.Contexts[name]
	if c == nil {
		if len(cfg.Contexts) == 0 {
			return nil, "", usagef("%s %q: %s has no contexts; create one with pvcli context set %s --endpoint URL", source, name, displayPath(path), name)
		}
		return nil, "", usagef("%s %q: no such context in %s (have: %s)", source, name, displayPath(path), strings.Join(contextNames(cfg), ", "))
	}
	return c, name, nil
}

func displayPath(p string) string {
	if p == "" {
		return "the pvcli configuration"
	}
	return p
}

// expandHome resolves a leading ~/ of a path in the configuration file.
func (a *app) expandHome(p string) string {
	if home := a.getenv("HOME"); home != "" && strings.HasPrefix(p, "~/") {
		return filepath.Join(home, p[2:])
	}
	return p
}

func (a *app) newContextCmd() *cobra.Command {
	setCmd := &cobra.Command{
		Use:   "set NAME [--endpoint URL,...] [--ca-file F] [--cert-file F] [--key-file F] [--token T]",
		Short: "Create or change a context from the global flags given (and make it current if there is none)",
		Args:  positional("NAME"),
		RunE: a.command(func(cmd *cobra.Command, args []string) error {
			cfg, path, err := a.loadConfig()
			if err != nil {
				return err
			}
			if cfg.Contexts == nil {
				cfg.Contexts = map[string]*cliContext{}
			}
			c := cfg.Contexts[args[0]]
			if c == nil {
				c = &cliContext{}
				cfg.Contexts[args[0]] = c
			}
			fl := cmd.Flags()
			if fl.Changed("endpoint") {
				eps := splitEndpoints(a.opts.endpoint)
				for _, e := range eps {
					if _, err := parseEndpoint(e, "http"); err != nil {
						return usagef("invalid --endpoint %q: %v; want http://HOST:PORT, https://HOST:PORT or HOST:PORT", e, err)
					}
				}
				c.Endpoints = eps
			}
			for _, f := range []struct {
				flag string
				dst  *string
				v    string
			}{{"ca-file", &c.CAFile, a.opts.tls.caFile}, {"cert-file", &c.CertFile, a.opts.tls.certFile}, {"key-file", &c.KeyFile, a.opts.tls.keyFile}} {
				if fl.Changed(f.flag) {
					if f.v != "" {
						abs, err := filepath.Abs(f.v)
						if err != nil {
							return usagef("--%s %s: %v", f.flag, f.v, err)
						}
						f.v = abs
					}
					*f.dst = f.v
				}
			}
			if fl.Changed("token") {
				c.Token = a.opts.token
			}
			if (c.CertFile == "") != (c.KeyFile == "") {
				return usagef("context %s: cert_file and key_file go together (give both --cert-file and --key-file)", args[0])
			}
			if cfg.CurrentContext == "" {
				cfg.CurrentContext = args[0]
			}
			if err := saveConfig(path, cfg); err != nil {
				return fmt.Errorf("save %s: %w", path, err)
			}
			fmt.Fprintf(a.stdout, "Context %s saved in %s", args[0], path)
			if cfg.CurrentContext == args[0] {
				fmt.Fprint(a.stdout, " (current)")
			}
			fmt.Fprintln(a.stdout)
			return nil
		}),
	}
	return groupCmd("context", "Named clusters and credentials in pvcli's configuration file ("+"~/.config/pvcli/config.yaml, or $"+envConfig+")",
		&cobra.Command{
			Use:   "list",
			Short: "List the contexts; * marks the current one",
			Args:  positional(),
			RunE: a.command(func(cmd *cobra.Command, _ []string) error {
				cfg, _, err := a.loadConfig()
				if err != nil {
					return err
				}
				return a.renderContexts(cfg)
			}),
		},
		&cobra.Command{
			Use:   "use NAME",
			Short: "Make NAME the current context",
			Args:  positional("NAME"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.changeContext(args[0], "Switched to context", func(cfg *cliConfig) { cfg.CurrentContext = args[0] })
			}),
		},
		setCmd,
		&cobra.Command{
			Use:   "delete NAME",
			Short: "Remove a context",
			Args:  positional("NAME"),
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				return a.changeContext(args[0], "Deleted context", func(cfg *cliConfig) {
					delete(cfg.Contexts, args[0])
					if cfg.CurrentContext == args[0] {
						cfg.CurrentContext = ""
					}
				})
			}),
		},
	)
}

// changeContext applies change to the configuration file when it holds
// the context name, and says done.
func (a *app) changeContext(name, done string, change func(*cliConfig)) error {
	cfg, path, err := a.loadConfig()
	if err != nil {
		return err
	}
	if cfg.Contexts[name] == nil {
		return usagef("no context %q in %s (have: %s); create it with pvcli context set %s --endpoint URL",
			name, displayPath(path), strings.Join(contextNames(cfg), ", "), name)
	}
	change(cfg)
	if err := saveConfig(path, cfg); err != nil {
		return fmt.Errorf("save %s: %w", path, err)
	}
	fmt.Fprintf(a.stdout, "%s %s\n", done, name)
	return nil
}

// contextView is a context as list prints it: the token is never shown.
type contextView struct {
	Name      string   `json:"name"`
	Current   bool     `json:"current"`
	Endpoints []string `json:"endpoints,omitempty"`
	CAFile    string   `json:"caFile,omitempty"`
	CertFile  string   `json:"certFile,omitempty"`
	KeyFile   string   `json:"keyFile,omitempty"`
	Token     bool     `json:"token"`
}

func (a *app) renderContexts(cfg *cliConfig) error {
	var views []contextView
	for _, n := range contextNames(cfg) {
		c := cfg.Contexts[n]
		views = append(views, contextView{Name: n, Current: n == cfg.CurrentContext, Endpoints: c.Endpoints,
			CAFile: c.CAFile, CertFile: c.CertFile, KeyFile: c.KeyFile, Token: c.Token != ""})
	}
	out := map[string]any{} // no contexts: {}, as protojson leaves out an empty list
	if len(views) > 0 {
		out["contexts"] = views
	}
	return a.renderValue(out, func(w io.Writer) {
		row(w, "CURRENT", "NAME", "ENDPOINTS", "CA-FILE", "CERT-FILE", "TOKEN")
		for _, v := range views {
			cur := ""
			if v.Current {
				cur = "*"
			}
			tok := "-"
			if v.Token {
				tok = "set"
			}
			row(w, cur, v.Name, strings.Join(v.Endpoints, ","), orDash(v.CAFile), orDash(v.CertFile), tok)
		}
	})
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// splitEndpoints splits a comma-separated endpoint list, dropping blanks.
func splitEndpoints(raw string) []string {
	var out []string
	for _, e := range strings.Split(raw, ",") {
		if e = strings.TrimSpace(e); e != "" && !slices.Contains(out, e) {
			out = append(out, e)
		}
	}
	return out
}
