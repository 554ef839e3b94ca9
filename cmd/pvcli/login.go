package main

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/identity/devoidc"
)

// newLoginCmd is pvcli login: a token of the development OIDC issuer (and
// of no other), saved in the context in force or printed.
func (a *app) newLoginCmd() *cobra.Command {
	var (
		dir, user, roles, issuer string
		ttl                      time.Duration
		printOnly                bool
	)
	c := &cobra.Command{
		Use:   "login --dir DIR --user NAME [--roles R1,R2] [--ttl 1h]",
		Short: "Get a bearer token from the development OIDC issuer (make cluster, pivirt-agent --dev) and save it in the current context",
		Long: `login asks the development OIDC issuer whose key and client secret are in --dir
(.cluster/certs for make cluster; <data dir>/dev-pki for pivirt-agent --dev) for
a token of --user with --roles, through its token endpoint. The token is saved in
the context in force (--context, ` + envContext + `, the current one) of the pvcli
configuration file, which later commands send; with no context, or --print, it
is printed alone, for export TOKEN=$(pvcli login ...).

Only the development issuer is asked: with another identity provider, get a
token its way and give it with --token, ` + envToken + ` or
pvcli context set NAME --token T.`,
		Args: positional(),
		RunE: a.command(func(cmd *cobra.Command, _ []string) error {
			if dir == "" || user == "" {
				return usagef("--dir and --user are required (--dir: the development issuer's directory, e.g. .cluster/certs)")
			}
			if ttl <= 0 || ttl > devoidc.MaxTTL {
				return usagef("--ttl %s: must be more than 0 and at most %s", ttl, devoidc.MaxTTL)
			}
			if issuer == "" {
				var err error
				if issuer, err = devoidc.IssuerURL(dir); err != nil {
					return usagef("%v", err)
				}
			}
			secret, err := os.ReadFile(filepath.Join(dir, devoidc.SecretFile))
			if err != nil {
				return usagef("the development issuer's client secret: %v", err)
			}
			timeout := a.opts.timeout
			if timeout <= 0 {
				timeout = defaultTimeout
			}
			ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
			defer cancel()
			tok, exp, err := devoidc.Fetch(ctx, &http.Client{}, issuer, strings.TrimSpace(string(secret)),
				devoidc.Request{User: user, Roles: devoidc.ParseRoles(roles), TTL: ttl})
			if err != nil {
				return fmt.Errorf("login: %w; pvcli login gets tokens from the development issuer only: with another identity provider, give its token with --token, %s or pvcli context set NAME --token T", err, envToken)
			}
			cur, name, err := a.activeContext(cmd)
			if err != nil {
				return err
			}
			if cur == nil || printOnly {
				fmt.Fprintln(a.stdout, tok)
				if cur == nil && !printOnly {
					// Said on stderr: $(pvcli login ...) still gets the token alone.
					fmt.Fprintf(a.stderr, "No pvcli context is in force, so the token was printed, not saved: later commands do not send it. "+
						"Send it with export %s=$(pvcli login ...), or save it in a context first: pvcli context set NAME --endpoint URL (then pvcli login again).\n", envToken)
				}
				return nil
			}
			cfg, path, err := a.loadConfig()
			if err != nil {
				return err
			}
			cfg.Contexts[name].Token = tok
			if err := saveConfig(path, cfg); err != nil {
				return fmt.Errorf("save %s: %w", path, err)
			}
			fmt.Fprintf(a.stdout, "Logged in as %s (roles %s) until %s: the token is saved in context %s of %s\n",
				user, strings.Join(devoidc.ParseRoles(roles), ", "), exp.Format(time.RFC3339), name, path)
			return nil
		}),
	}
	f := c.Flags()
	f.StringVar(&dir, "dir", "", "the development issuer's directory (its "+devoidc.SecretFile+" and "+devoidc.IssuerFile+")")
	f.StringVar(&user, "user", "", "the identity of the token (sub)")
	f.StringVar(&roles, "roles", "", "roles, comma-separated (e.g. vm-owner or admin,viewer)")
	f.DurationVar(&ttl, "ttl", devoidc.DefaultTTL, "lifetime of the token")
	f.StringVar(&issuer, "issuer", "", "the issuer URL (default: the one recorded in --dir)")
	f.BoolVar(&printOnly, "print", false, "print the token instead of saving it in the context in force")
	return c
}
