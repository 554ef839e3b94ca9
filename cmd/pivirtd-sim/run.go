package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"log/slog"
	"os"
	"time"

	"pilab.hu/pivirt-agent/cmd/internal/caclient"
	"pilab.hu/pivirt-agent/cmd/internal/version"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/durationpb"

	"pilab.hu/pivirt-agent/cmd/internal/sim"
	"pilab.hu/pivirt-agent/gateway/observe"
	"pilab.hu/pivirt-agent/identity"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
)

// MaxMessageBytes bounds gRPC messages both ways; the agent's gateway uses
// the same limit.
const MaxMessageBytes = 16 << 20

// stopGrace is how long in-flight calls get at shutdown.
const stopGrace = 5 * time.Second

// usageError is bad input: exit status 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

type options struct {
	listen, dataDir, host, logFormat string
	roles                            []string
	certFile, keyFile, caFile        string
	caServer                         string
	renewBefore                      time.Duration
	delay                            time.Duration
	failPercent, failCode            uint32
}

// Run runs pivirtd-sim with args until ctx ends.
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cmd := newRootCmd(stdout, stderr)
	cmd.SetArgs(args)
	return cmd.ExecuteContext(ctx)
}

// newRootCmd is the command tree (also what the CLI reference in docs/ is
// generated from).
func newRootCmd(stdout, stderr io.Writer) *cobra.Command {
	var o options
	cmd := &cobra.Command{
		Use:   "pivirtd-sim --listen ADDR --data-dir DIR",
		Short: "Simulated pivirtd and iscsiman backends for pivirt-agent (not a hypervisor)",
		Long: `pivirtd-sim serves pivirt.vm.v1.VMService and pivirt.network.v1.NetworkService (role
pivirtd) and pivirt.storage.v1.StorageService (role iscsiman) over gRPC, keeping its
state in <data-dir>/sim.db, with grpc.health.v1 and server reflection. Its control API,
pivirt.sim.v1.SimulatorService on the same listener, makes calls fail or slow down and
sets the health status, for tests; --delay and --fail-* set a fault from the start.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) > 0 {
				return &usageError{fmt.Errorf("unknown command %q for \"pivirtd-sim\" (it takes only flags)", args[0])}
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := o.check(); err != nil {
				return &usageError{err}
			}
			return serve(cmd.Context(), o, stdout)
		},
	}
	version.AddFlag(cmd, version.Get("pivirtd-sim"))
	cmd.SetOut(stdout)
	cmd.SetErr(stderr)
	cmd.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return &usageError{err} })
	f := cmd.Flags()
	f.StringVar(&o.listen, "listen", "", "unix:///abs/path or host:port")
	f.StringVar(&o.dataDir, "data-dir", "", "directory of the simulator's state (sim.db)")
	f.StringSliceVar(&o.roles, "role", []string{sim.RolePivirtd, sim.RoleIscsiman}, "roles to play: pivirtd (VMs, networks), iscsiman (volumes)")
	f.StringVar(&o.host, "host", "", "node name VMs report (default: the host name)")
	f.StringVar(&o.logFormat, "log-format", "json", "json or text")
	f.StringVar(&o.certFile, "tls-cert-file", "", "server certificate: serve TLS (with --tls-key-file and --tls-ca-file)")
	f.StringVar(&o.keyFile, "tls-key-file", "", "server certificate's key")
	f.StringVar(&o.caFile, "tls-ca-file", "", "CA chain client certificates must verify against (required with TLS: clients must present one)")
	f.StringVar(&o.caServer, "ca-server", "", "PiTrust CA server (https://host:port) to renew the --tls-cert-file certificate through, --renew-before its expiry")
	f.DurationVar(&o.renewBefore, "renew-before", 30*24*time.Hour, "with --ca-server: renew when this much or less of the certificate's lifetime remains")
	f.DurationVar(&o.delay, "delay", 0, "delay every API call by this much")
	f.Uint32Var(&o.failPercent, "fail-percent", 0, "fail this percentage of API calls (with --fail-code)")
	f.Uint32Var(&o.failCode, "fail-code", uint32(codes.Unavailable), "gRPC status code of failed calls")
	return cmd
}

func (o *options) check() error {
	switch {
	case o.listen == "":
		return fmt.Errorf("--listen: required (unix:///abs/path or host:port)")
	case o.dataDir == "":
		return fmt.Errorf("--data-dir: required")
	case o.logFormat != "json" && o.logFormat != "text":
		return fmt.Errorf("--log-format: %q, want json or text", o.logFormat)
	case (o.certFile == "") != (o.keyFile == "") || (o.certFile == "") != (o.caFile == ""):
		return fmt.Errorf("--tls-cert-file, --tls-key-file and --tls-ca-file go together")
	case o.caServer != "" && o.certFile == "":
		return fmt.Errorf("--ca-server renews the --tls-cert-file certificate: give the TLS flags too")
	case o.renewBefore < time.Minute:
		return fmt.Errorf("--renew-before: %s, at least 1m", o.renewBefore)
	case o.delay < 0:
		return fmt.Errorf("--delay: %s must not be negative", o.delay)
	case o.failPercent > 100:
		return fmt.Errorf("--fail-percent: %d, want 0 to 100", o.failPercent)
	case o.failCode == 0 || o.failCode > uint32(codes.Unauthenticated):
		return fmt.Errorf("--fail-code: %d, want a gRPC error code 1 to 16", o.failCode)
	}
	return nil
}

func serve(ctx context.Context, o options, stdout io.Writer) error {
	logOpts := observe.HandlerOptions(nil)
	var h slog.Handler = slog.NewJSONHandler(stdout, logOpts)
	if o.logFormat == "text" {
		h = slog.NewTextHandler(stdout, logOpts)
	}
	logger := slog.New(h).With("component", "pivirtd-sim")
	s, err := sim.Open(sim.Config{DataDir: o.dataDir, Roles: o.roles, Host: o.host, Logger: logger})
	if err != nil {
		return err
	}
	defer s.Close()
	if o.delay > 0 || o.failPercent > 0 {
		ft := &simv1.Fault{Method: "*", Delay: durationpb.New(o.delay), Percent: o.failPercent}
		if o.failPercent > 0 {
			ft.Code = o.failCode
		}
		if _, err := s.SetFault(ft); err != nil {
			return &usageError{err}
		}
	}
	opts := append(s.ServerOptions(), grpc.MaxRecvMsgSize(MaxMessageBytes), grpc.MaxSendMsgSize(MaxMessageBytes))
	if o.certFile != "" {
		src, err := identity.NewSource(identity.SourceConfig{CertFile: o.certFile, KeyFile: o.keyFile, CAFile: o.caFile, Logger: logger})
		if err != nil {
			return err
		}
		go src.Watch(ctx, 5*time.Second)
		if o.caServer != "" {
			r, err := renewer(o, src, logger)
			if err != nil {
				return &usageError{err}
			}
			go r.Run(ctx)
		}
		opts = append(opts, grpc.Creds(credentials.NewTLS(src.ServerConfig(tls.RequireAndVerifyClientCert, nil))))
	}
	ln, err := sim.Listen(o.listen)
	if err != nil {
		return err
	}
	gs := grpc.NewServer(opts...)
	s.Register(gs)
	served := make(chan error, 1)
	go func() { served <- gs.Serve(ln) }()
	logger.Info("pivirtd-sim serving", "listen", o.listen, "addr", ln.Addr().String(), "services", s.Services(), "tls", o.certFile != "")
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	stopped := make(chan struct{})
	go func() { gs.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(stopGrace):
		gs.Stop()
	}
	logger.Info("pivirtd-sim stopped")
	return nil
}

// renewer renews the server certificate through the CA server of
// --ca-server. The simulator has no client certificate: the renewal's
// proof by the current key is its authentication.
func renewer(o options, src *identity.Source, logger *slog.Logger) (*identity.Renewer, error) {
	host, err := caclient.ServerName(o.caServer)
	if err != nil {
		return nil, fmt.Errorf("--ca-server: %w", err)
	}
	pemCA, err := os.ReadFile(o.caFile)
	if err != nil {
		return nil, fmt.Errorf("--tls-ca-file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pemCA) {
		return nil, fmt.Errorf("--tls-ca-file %s: no PEM certificate in it", o.caFile)
	}
	client, err := caclient.New(o.caServer, &tls.Config{RootCAs: pool, ServerName: host, MinVersion: tls.VersionTLS12})
	if err != nil {
		return nil, fmt.Errorf("--ca-server: %w", err)
	}
	return &identity.Renewer{Name: "server", Source: src, CA: "the PiTrust CA server " + o.caServer,
		Ask: caclient.Asker(client, o.caServer), Due: identity.RenewBeforeExpiry(o.renewBefore), Logger: logger}, nil
}
