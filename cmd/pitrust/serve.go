package main

import (
	"io"
	"log/slog"

	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/cmd/internal/caserver"
)

// DefaultConfigFile is where pitrust serve reads its configuration.
const DefaultConfigFile = "/etc/pitrust/pitrust.yaml"

// serveHook, when set (tests), is called with the server once it listens.
var serveHook func(*caserver.Server)

func serveCmd(stderr io.Writer) *cobra.Command {
	var configFile, addr string
	c := &cobra.Command{
		Use:   "serve",
		Short: "Run the PiTrust CA server: the certificate API over TLS, OCSP and the CRL over plain HTTP",
		Long: `Run the PiTrust CA server on server.addr of the configuration file (--config).
One port serves both: TLS connections get the pivirt.pitrust.v1.CertificateService
API (Connect, gRPC and gRPC-Web, HTTP/2 and HTTP/1.1), authenticated by client
certificates (auth.certificate_roles: the pitrust-admin role may issue, revoke,
list and create bootstrap tokens) or by a bootstrap token; plain HTTP
connections get the OCSP responder (/ocsp) and the CRL (/crl). /healthz answers
on both.

The CA is the X1 intermediate of server.certs_dir (pitrust init); every
certificate issued is recorded in server.db_path. When the server's own
certificate (server.tls, default <certs_dir>/pitrust-server.crt and .key) is
missing, serve issues it from the CA (and renews what it issued at two thirds
of its lifetime). Logs are JSON lines on stderr; audit
lines have "msg":"audit". SIGINT or SIGTERM stop it gracefully.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := caserver.LoadConfig(configFile)
			if err != nil {
				return err
			}
			if addr != "" {
				cfg.Server.Addr = addr
			}
			logger := slog.New(slog.NewJSONHandler(stderr, nil))
			srv, err := caserver.New(cfg, logger)
			if err != nil {
				return err
			}
			if serveHook != nil {
				serveHook(srv)
			}
			return srv.Serve(cmd.Context())
		},
	}
	c.Flags().StringVar(&configFile, "config", DefaultConfigFile, "configuration file (YAML)")
	c.Flags().StringVar(&addr, "addr", "", "listen on this host:port instead of server.addr")
	return c
}
