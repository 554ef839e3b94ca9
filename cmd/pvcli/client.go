package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
	"pilab.hu/pivirt-agent/proto/pivirt/network/v1/networkv1connect"
	"pilab.hu/pivirt-agent/proto/pivirt/schedule/v1/schedulev1connect"
	"pilab.hu/pivirt-agent/proto/pivirt/storage/v1/storagev1connect"
	"pilab.hu/pivirt-agent/proto/pivirt/vm/v1/vmv1connect"
)

const (
	// maxMessageBytes bounds messages in both directions (connect's default
	// is unlimited).
	maxMessageBytes = 16 << 20

	retryInitialBackoff = 100 * time.Millisecond
	retryMaxBackoff     = 2 * time.Second
)

// metaHeaders are the response headers describing the state a read was
// served from (QueryMeta); --verbose prints them.
var metaHeaders = []string{"Pivirt-Index", "Pivirt-Known-Leader", "Pivirt-Last-Contact", "Pivirt-Served-By"}

// clientConn is the API client of one invocation.
type clientConn struct {
	// endpoints picks the agent of each request among --endpoint's.
	endpoints *failoverTransport
	http      *http.Client
	api       clusterv1connect.ClusterServiceClient
	// snap streams snapshots; streams are not retried by the interceptor.
	snap clusterv1connect.SnapshotServiceClient
	// agent streams an agent's log and support bundle (not retried).
	agent clusterv1connect.AgentServiceClient
	// The backend APIs the agent proxies. pvcli does not retry them: the
	// agent retries what is safe to retry.
	vm vmv1connect.VMServiceClient
	// schedule is the agent's own schedule API: writes carry a client ID
	// and sequence, so it is retried like the cluster API.
	schedule schedulev1connect.ScheduleServiceClient
	storage  storagev1connect.StorageServiceClient
	network  networkv1connect.NetworkServiceClient
}

func (c *clientConn) close() { c.http.CloseIdleConnections() }

// rpcFunc is the body of a command that talks to the cluster.
type rpcFunc func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error

// call validates the global flags, connects to the endpoint and runs fn under
// the --timeout deadline. Commands validate their own input before call, so
// bad input never reaches the network.
func (a *app) call(cmd *cobra.Command, fn rpcFunc) error {
	if err := a.connect(cmd); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), a.opts.timeout)
	defer cancel()
	return fn(ctx, a.conn.api)
}

// connect validates the global flags and builds the clients on first use.
func (a *app) connect(cmd *cobra.Command) error {
	if err := a.validateGlobals(); err != nil {
		return err
	}
	if a.conn != nil {
		return nil
	}
	t, err := a.resolveTarget(cmd)
	if err != nil {
		return err
	}
	a.target = t
	endpoint := t.endpoints[0]
	base, err := newHTTPClient(endpoint, t.tls)
	if err != nil {
		return err
	}
	failover := &failoverTransport{base: base.Transport, endpoints: t.endpoints, app: a}
	httpClient := &http.Client{Transport: failover}
	var auth []connect.Interceptor
	if t.token != "" {
		for _, ep := range t.endpoints {
			if ep.Scheme != "https" && !loopbackHost(ep.Hostname()) {
				return usagef("--token needs an https:// endpoint: a bearer token sent in clear text to %s could be taken and replayed", ep.Host)
			}
		}
		auth = append(auth, bearer(t.token))
	}
	a.conn = &clientConn{
		endpoints: failover,
		http:      httpClient,
		api: clusterv1connect.NewClusterServiceClient(httpClient, endpoint.String(),
			connect.WithInterceptors(append(auth, a.retryInterceptor())...),
			connect.WithReadMaxBytes(maxMessageBytes),
			connect.WithSendMaxBytes(maxMessageBytes),
			connect.WithCompressMinBytes(1024),
		),
		snap: clusterv1connect.NewSnapshotServiceClient(httpClient, endpoint.String(),
			connect.WithInterceptors(auth...),
			connect.WithReadMaxBytes(maxMessageBytes),
			connect.WithSendMaxBytes(maxMessageBytes),
		),
	}
	a.conn.schedule = schedulev1connect.NewScheduleServiceClient(httpClient, endpoint.String(),
		connect.WithInterceptors(append(auth, a.retryInterceptor())...),
		connect.WithReadMaxBytes(maxMessageBytes),
		connect.WithSendMaxBytes(maxMessageBytes),
	)
	a.conn.agent = clusterv1connect.NewAgentServiceClient(httpClient, endpoint.String(),
		connect.WithInterceptors(auth...),
		connect.WithReadMaxBytes(maxMessageBytes),
		connect.WithSendMaxBytes(maxMessageBytes),
	)
	backendOpts := []connect.ClientOption{connect.WithInterceptors(auth...), connect.WithReadMaxBytes(maxMessageBytes), connect.WithSendMaxBytes(maxMessageBytes)}
	a.conn.vm = vmv1connect.NewVMServiceClient(httpClient, endpoint.String(), backendOpts...)
	a.conn.storage = storagev1connect.NewStorageServiceClient(httpClient, endpoint.String(), backendOpts...)
	a.conn.network = networkv1connect.NewNetworkServiceClient(httpClient, endpoint.String(), backendOpts...)
	return nil
}

// backendCall connects and runs fn under the --timeout deadline; with
// stream set and no --timeout given, without a deadline (a watch runs
// until interrupted).
func (a *app) backendCall(cmd *cobra.Command, stream bool, fn func(ctx context.Context, c *clientConn) error) error {
	if err := a.connect(cmd); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(cmd.Context(), a.opts.timeout)
	if stream && !a.opts.timeoutSet {
		ctx, cancel = context.WithCancel(cmd.Context())
	}
	defer cancel()
	return fn(ctx, a.conn)
}

// target is where and how pvcli reaches the cluster.
type target struct {
	endpoints []*url.URL
	tls       tlsOptions
	token     string
}

// resolveTarget resolves the endpoints, TLS files and token: each from its
// flag, else its environment variable, else the context in force (--context,
// $PVCLI_CONTEXT or the configuration file's current context), else the
// default. An endpoint without a scheme is https:// when a CA file or a
// client certificate is given, else http://.
func (a *app) resolveTarget(cmd *cobra.Command) (*target, error) {
	ctx, ctxName, err := a.activeContext(cmd)
	if err != nil {
		return nil, err
	}
	if ctx == nil {
		ctx = &cliContext{}
	}
	t := &target{tls: a.tlsOptions(cmd, ctx), token: a.token(cmd, ctx)}

	raw, source := splitEndpoints(a.opts.endpoint), "--endpoint"
	switch {
	case cmd.Flags().Changed("endpoint"):
	case a.getenv(envEndpoint) != "":
		raw, source = splitEndpoints(a.getenv(envEndpoint)), envEndpoint
	case len(ctx.Endpoints) > 0:
		raw, source = ctx.Endpoints, "context "+ctxName+" endpoints"
	}
	if len(raw) == 0 {
		return nil, usagef("invalid %s: no endpoint given; want http://HOST:PORT, https://HOST:PORT or HOST:PORT, several separated by commas", source)
	}
	scheme := "http"
	if t.tls.caFile != "" || (t.tls.certFile != "" && !t.tls.defaulted) {
		scheme = "https"
	}
	for _, r := range raw {
		u, err := parseEndpoint(r, scheme)
		if err != nil {
			return nil, usagef("invalid %s %q: %v; want http://HOST:PORT, https://HOST:PORT or HOST:PORT", source, r, err)
		}
		if len(t.endpoints) > 0 && u.Scheme != t.endpoints[0].Scheme {
			return nil, usagef("invalid %s: %s and %s mix http:// and https://; the agents of one cluster speak one of them", source, t.endpoints[0], u)
		}
		t.endpoints = append(t.endpoints, u)
	}
	return t, nil
}

// loopbackHost reports whether host is a loopback address or localhost.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// parseEndpoint accepts http://HOST[:PORT][/PATH], https://... and HOST:PORT,
// which means scheme://HOST:PORT.
func parseEndpoint(raw, scheme string) (*url.URL, error) {
	if !strings.Contains(raw, "://") {
		host, port, err := net.SplitHostPort(raw)
		if err != nil {
			return nil, err
		}
		if host == "" || port == "" {
			return nil, fmt.Errorf("host and port must not be empty")
		}
		raw = scheme + "://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil {
		return nil, err
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return nil, fmt.Errorf("unsupported scheme %q", u.Scheme)
	case u.Hostname() == "":
		return nil, fmt.Errorf("missing host")
	case u.User != nil || u.RawQuery != "" || u.Fragment != "":
		return nil, fmt.Errorf("user info, query and fragment are not allowed")
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	return u, nil
}

// defaultCertFile and defaultKeyFile are the client certificate pvcli
// presents to https:// endpoints when none is given, below the user's
// configuration directory.
const (
	defaultCertFile = "~/.config/pvcli/client.crt"
	defaultKeyFile  = "~/.config/pvcli/client.key"
)

// tlsOptions resolves the TLS flags, each from its environment variable
// when the flag was not given, else from the context; without a
// certificate given, the files of defaultCertFile and defaultKeyFile are
// used when both exist.
func (a *app) tlsOptions(cmd *cobra.Command, c *cliContext) tlsOptions {
	o := a.opts.tls
	for _, f := range []struct {
		flag, env, ctx string
		v              *string
	}{{"ca-file", envCAFile, c.CAFile, &o.caFile}, {"cert-file", envCertFile, c.CertFile, &o.certFile}, {"key-file", envKeyFile, c.KeyFile, &o.keyFile}} {
		if !cmd.Flags().Changed(f.flag) {
			if v := a.getenv(f.env); v != "" {
				*f.v = v
			} else if f.ctx != "" {
				*f.v = a.expandHome(f.ctx)
			}
		}
	}
	if o.certFile == "" && o.keyFile == "" {
		if home := a.getenv("HOME"); home != "" {
			cert, key := filepath.Join(home, ".config", "pvcli", "client.crt"), filepath.Join(home, ".config", "pvcli", "client.key")
			if fileExists(cert) && fileExists(key) {
				o.certFile, o.keyFile, o.defaulted = cert, key, true
			}
		}
	}
	return o
}

func fileExists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}

// token resolves --token, else PVCLI_TOKEN, else the context's.
func (a *app) token(cmd *cobra.Command, c *cliContext) string {
	if cmd.Flags().Changed("token") {
		return a.opts.token
	}
	if v := a.getenv(envToken); v != "" {
		return v
	}
	return c.Token
}

// bearer sends the token as Authorization: Bearer on every call.
func bearer(token string) connect.Interceptor {
	return bearerInterceptor{value: "Bearer " + token}
}

type bearerInterceptor struct{ value string }

func (b bearerInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", b.value)
		return next(ctx, req)
	}
}

func (b bearerInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", b.value)
		return conn
	}
}

func (bearerInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// tlsOptions are the client TLS flags.
type tlsOptions struct {
	caFile, certFile, keyFile string
	// defaulted: the certificate is the one of the configuration
	// directory, not given; plaintext endpoints ignore it.
	defaulted bool
}

// newHTTPClient builds the HTTP client for endpoint; it is the one place that
// decides how pvcli reaches an agent.
//
// http:// speaks HTTP/2 over cleartext TCP with prior knowledge (h2c), so
// streaming RPCs work without TLS. https:// negotiates HTTP/2 through ALPN
// and verifies the server against --ca-file (else the system roots),
// presenting --cert-file/--key-file when given (agents that require client
// certificates).
func newHTTPClient(endpoint *url.URL, opts tlsOptions) (*http.Client, error) {
	switch endpoint.Scheme {
	case "http":
		if opts.defaulted {
			opts.certFile, opts.keyFile = "", ""
		}
		if opts.caFile != "" || opts.certFile != "" {
			return nil, usagef("--ca-file and --cert-file need an https:// endpoint")
		}
		t := &http.Transport{
			DialContext:     (&net.Dialer{KeepAlive: 30 * time.Second}).DialContext,
			IdleConnTimeout: 90 * time.Second,
			Protocols:       new(http.Protocols),
		}
		t.Protocols.SetUnencryptedHTTP2(true)
		return &http.Client{Transport: t}, nil
	case "https":
		cfg := &tls.Config{MinVersion: tls.VersionTLS12}
		if opts.caFile != "" {
			pem, err := os.ReadFile(opts.caFile)
			if err != nil {
				return nil, usagef("--ca-file: %v", err)
			}
			cfg.RootCAs = x509.NewCertPool()
			if !cfg.RootCAs.AppendCertsFromPEM(pem) {
				return nil, usagef("--ca-file %s: no PEM certificate in it", opts.caFile)
			}
		}
		if (opts.certFile == "") != (opts.keyFile == "") {
			return nil, usagef("--cert-file and --key-file go together")
		}
		if opts.certFile != "" {
			pair, err := tls.LoadX509KeyPair(opts.certFile, opts.keyFile)
			if err != nil {
				if opts.defaulted {
					return nil, usagef("the default client certificate %s and %s: %v (give --cert-file/--key-file, or fix or remove them)", opts.certFile, opts.keyFile, err)
				}
				return nil, usagef("--cert-file/--key-file: %v", err)
			}
			cfg.Certificates = []tls.Certificate{pair}
		}
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.TLSClientConfig = cfg
		t.ForceAttemptHTTP2 = true
		return &http.Client{Transport: t}, nil
	default:
		return nil, fmt.Errorf("unsupported endpoint scheme %q: want http or https", endpoint.Scheme)
	}
}

// retryInterceptor resends a request that failed with Unavailable (no
// leader, leader change, agent restarting, connection refused) with jittered
// exponential backoff until the deadline. The request is resent unchanged,
// so a write keeps its client ID and sequence number and the cluster applies
// it at most once. The agent's answer that there is no leader (or, in etcd
// mode, that etcd did not answer) comes after it waited: it is retried
// only while another wait as long fits before the deadline, so that the
// answer printed is one of a whole wait.
func (a *app) retryInterceptor() connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			backoff := retryInitialBackoff
			var unavailable error
			for attempt := 1; ; attempt++ {
				start := time.Now()
				resp, err := next(ctx, req)
				if err == nil {
					a.printMeta(resp.Header())
					return resp, nil
				}
				switch connect.CodeOf(err) {
				case connect.CodeUnavailable:
					if permanentTransportError(err) {
						return nil, err
					}
					if deadline, ok := ctx.Deadline(); ok && waitedInVain(err) && time.Until(deadline) < time.Since(start) {
						return nil, err
					}
					unavailable = err
				case connect.CodeDeadlineExceeded:
					// The deadline ran out during a retry (the agent may
					// answer so just before this side notices): the reason
					// for retrying says more than "deadline exceeded".
					if unavailable != nil {
						return nil, unavailable
					}
					return nil, err
				default:
					return nil, err
				}
				wait := backoff/2 + rand.N(backoff/2+1)
				if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= wait {
					return nil, err
				}
				if a.opts.verbose {
					fmt.Fprintf(a.stderr, "attempt %d of %s failed (%v); retrying in %s\n",
						attempt, req.Spec().Procedure, err, wait.Round(time.Millisecond))
				}
				timer := time.NewTimer(wait)
				select {
				case <-ctx.Done():
					timer.Stop()
					return nil, err
				case <-timer.C:
				}
				backoff = min(2*backoff, retryMaxBackoff)
			}
		}
	}
}

// permanentTransportError reports whether an Unavailable error comes from a
// TLS failure that a retry cannot cure: an untrusted or mismatched
// certificate, or TLS spoken to a plain-text port.
func permanentTransportError(err error) bool {
	var (
		verify     *tls.CertificateVerificationError
		header     tls.RecordHeaderError
		authority  x509.UnknownAuthorityError
		hostname   x509.HostnameError
		invalid    x509.CertificateInvalidError
		alertError tls.AlertError
	)
	return errors.As(err, &verify) || errors.As(err, &header) || errors.As(err, &authority) ||
		errors.As(err, &hostname) || errors.As(err, &invalid) || errors.As(err, &alertError) ||
		// net/http turns the RecordHeaderError of an HTTP/1 answer into
		// this untyped error, and a TLS alert of the server (a client
		// certificate required or refused) reaches here as text.
		strings.Contains(err.Error(), "server gave HTTP response to HTTPS client") ||
		strings.Contains(err.Error(), "remote error: tls: ")
}

func (a *app) printMeta(h http.Header) {
	if !a.opts.verbose {
		return
	}
	for _, k := range metaHeaders {
		if v := h.Get(k); v != "" {
			fmt.Fprintf(a.stderr, "%s: %s\n", k, v)
		}
	}
}
