package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/identity/devoidc"
)

// DefaultDevIssuerAddr is where pitrust dev-issuer listens by default.
const DefaultDevIssuerAddr = "127.0.0.1:8440"

func devIssuerCmd(dir *string, stdout, stderr io.Writer) *cobra.Command {
	var addr string
	c := &cobra.Command{
		Use:   "dev-issuer [--addr 127.0.0.1:PORT]",
		Short: "Serve a local OIDC issuer for development (discovery, JWKS, token and authorization endpoints) on loopback",
		Long: `dev-issuer serves an OpenID Connect issuer for development on a loopback
address, until interrupted: the discovery document
(/.well-known/openid-configuration), the JWKS (/keys), a token endpoint
(/token) and an authorization endpoint (/authorize). Its signing key is
` + devoidc.KeyFile + ` in --dir, made on first start with the client secret
(` + devoidc.SecretFile + `); the issuer's URL is written to ` + devoidc.IssuerFile + ` there, for
pitrust dev-token.

Point agents at it with:

  auth:
    oidc:
      issuer_url: http://127.0.0.1:8440
      allow_http_issuer: true   # development only
      client_id: ` + devoidc.Audience + `

and get a token with pitrust dev-token --dir DIR --user alice --roles vm-owner,
or from the token endpoint:

  curl -u ` + devoidc.Audience + `:$(cat DIR/` + devoidc.SecretFile + `) -d grant_type=client_credentials \
    -d user=alice -d roles=vm-owner -d ttl=1h http://127.0.0.1:8440/token

A browser page on loopback (the agents' web UI) signs in with the
authorization code flow and PKCE, as the public client ` + devoidc.Audience + `:
/authorize (response_type=code, code_challenge_method=S256, a redirect_uri
on 127.0.0.1, ::1 or localhost) shows a form asking for any user name and
roles, and a password: the content of ` + devoidc.SecretFile + `. The code it
redirects with is exchanged once, within ` + fmt.Sprint(devoidc.CodeTTL.Seconds()) + ` s, at /token
(grant_type=authorization_code with the code_verifier). Discovery, /keys
and /token answer CORS requests of loopback origins.

Not an identity provider: anyone who can read the key or the secret gets any
identity and any role. Real deployments point auth.oidc at their own issuer.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			is, ln, err := devoidc.Listen(*dir, addr)
			if err != nil {
				return err
			}
			srv := &http.Server{Handler: is.Handler(), ReadHeaderTimeout: 10 * time.Second}
			fmt.Fprintf(stdout, "dev OIDC issuer %s (key %s/%s), client_id %s; stop with Ctrl-C\n", is.URL, *dir, devoidc.KeyFile, devoidc.Audience)
			fmt.Fprintf(stdout, "  export TOKEN=$(pitrust dev-token --dir %s --user alice --roles vm-owner)\n", *dir)
			errc := make(chan error, 1)
			go func() { errc <- srv.Serve(ln) }()
			select {
			case err := <-errc:
				return err
			case <-cmd.Context().Done():
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := srv.Shutdown(ctx); err != nil {
				return err
			}
			if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
				return err
			}
			fmt.Fprintln(stderr, "dev OIDC issuer stopped")
			return nil
		},
	}
	c.Flags().StringVar(&addr, "addr", DefaultDevIssuerAddr, "loopback address to listen on (port 0: any free port)")
	return c
}

func devTokenCmd(dir *string, stdout io.Writer) *cobra.Command {
	var (
		user, roles, issuer string
		ttl                 time.Duration
	)
	c := &cobra.Command{
		Use:   "dev-token --user NAME [--roles R1,R2] [--ttl 1h]",
		Short: "Mint a bearer token of the dev OIDC issuer with its key in --dir (offline), printed alone",
		Long: `dev-token signs a token with the dev OIDC issuer's key in --dir (` + devoidc.KeyFile + `,
made by pitrust dev-issuer or pivirt-agent --dev) and prints it alone on a line,
so that

  export TOKEN=$(pitrust dev-token --dir DIR --user alice --roles vm-owner)
  pvcli --token "$TOKEN" vm list
  curl --cacert DIR/ca-chain.pem -H "authorization: Bearer $TOKEN" ...

work. The token's iss is the URL of the issuer that last served from --dir
(` + devoidc.IssuerFile + `; --issuer names another), aud is ` + devoidc.Audience + `, sub the user, and
roles the roles; it lives --ttl (at most ` + devoidc.MaxTTL.String() + `).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if user == "" {
				return &usageError{errors.New("--user is required")}
			}
			if ttl <= 0 || ttl > devoidc.MaxTTL {
				return &usageError{fmt.Errorf("--ttl %s: must be more than 0 and at most %s", ttl, devoidc.MaxTTL)}
			}
			key, err := devoidc.LoadKey(*dir)
			if err != nil {
				return fmt.Errorf("%w (start pitrust dev-issuer --dir %s, or pivirt-agent --dev, to make one)", err, *dir)
			}
			if issuer == "" {
				if issuer, err = devoidc.IssuerURL(*dir); err != nil {
					return err
				}
			}
			raw, _, err := key.Mint(devoidc.Request{Issuer: issuer, User: user, Roles: devoidc.ParseRoles(roles), TTL: ttl})
			if err != nil {
				return &usageError{err}
			}
			_, err = fmt.Fprintln(stdout, raw)
			return err
		},
	}
	c.Flags().StringVar(&user, "user", "", "the caller's identity (sub)")
	c.Flags().StringVar(&roles, "roles", "", "roles, comma-separated (e.g. vm-owner or admin,viewer)")
	c.Flags().DurationVar(&ttl, "ttl", devoidc.DefaultTTL, "lifetime of the token")
	c.Flags().StringVar(&issuer, "issuer", "", "the issuer URL for iss (default: the one recorded in --dir)")
	return c
}
