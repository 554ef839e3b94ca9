package agent

import (
	"path/filepath"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity/devoidc"
)

// devIssuer serves a development OIDC issuer for --dev on a free port of
// 127.0.0.1, its key in the dev PKI's directory, and points auth.oidc at
// it, so that bearer tokens (pitrust dev-token) can be tried without an
// outside identity provider. The API port then takes callers without a
// client certificate too (they still need a token or a certificate: access
// control is on). Only with the dev PKI, and only when the --config file
// names no issuer of its own.
func (a *Agent) devIssuer() error {
	if a.devCreds.Endpoint == "" || a.cfg.Auth.OIDC.IssuerURL != "" {
		return nil
	}
	dir := filepath.Join(a.dataDir, DevPKIDir)
	is, ln, err := devoidc.Listen(dir, "127.0.0.1:0")
	if err != nil {
		return err
	}
	a.serve(ln, is.Handler())
	cfg := *a.cfg // the caller's configuration stays as it was given
	cfg.Auth.OIDC = config.OIDCConfig{IssuerURL: is.URL, ClientID: devoidc.Audience}
	cfg.TLS.RequireClientCert = false
	a.cfg = &cfg
	a.devCreds.IssuerURL, a.devCreds.IssuerDir = is.URL, dir
	a.logger.Info("dev mode: a development OIDC issuer for bearer tokens", "issuer", is.URL, "dir", dir)
	return nil
}
