package leader

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cluster"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/identity"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/node/v1/nodev1connect"
)

const (
	// renewRetryMin and renewRetryMax bound the backoff between failed
	// installs of the cluster CA.
	renewRetryMin = time.Second
	renewRetryMax = time.Minute
	// caCheckInterval is how often the leader compares the configured
	// intermediate with the installed one.
	caCheckInterval = 10 * time.Minute
)

// CAConfig wires a [ClusterCA].
type CAConfig struct {
	// CA is tls.cluster_ca.
	CA     config.ClusterCAConfig
	NodeID string
	Logger *slog.Logger
	// Trust is the peers' TLS source: certificates the CA signs, and the
	// CA itself, must verify against its tls.ca_file.
	Trust *identity.Source
	// FSM holds the installed CA (the ca table).
	FSM *fsm.FSM
	// Proposer proposes the install (Raft).
	Proposer Proposer
	// Ready reports whether this node leads with its state established
	// (only then does it sign).
	Ready func() bool
	// Leader returns the leader's node ID ("" when none is known) and
	// Raft address.
	Leader func() (id, raftAddr string)
	// Members finds the leader's internal address; Node dials it.
	Members interface {
		ServerByID(id, raftAddr string) (cluster.Member, bool)
	}
	Node       func(addr string) nodev1connect.NodeServiceClient
	Registerer prometheus.Registerer
}

// ClusterCA is the built-in cluster CA of an agent (tls.cluster_ca): on
// the leader it installs the configured intermediate into the replicated
// state and signs renewals; on every agent it renews the agent's own server
// and client certificates at a random 60-90% of their lifetime.
type ClusterCA struct {
	cfg     CAConfig
	limiter *rate.Limiter
	// signed counts the renewals this node answered as leader, by result;
	// renewed the renewals of this node's own certificates.
	signed  *prometheus.CounterVec
	renewed *prometheus.CounterVec

	mu                    sync.Mutex
	cached                *identity.CertAuthority
	cachedCert, cachedKey []byte
}

// NewClusterCA returns the cluster CA of cfg and registers its metrics.
func NewClusterCA(cfg CAConfig) *ClusterCA {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	c := &ClusterCA{
		cfg:     cfg,
		limiter: rate.NewLimiter(rate.Limit(cfg.CA.CSRMaxPerSecond), cfg.CA.CSRBurst),
		signed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_ca_signed_total",
			Help: "Certificate renewals answered by this node as the leader's cluster CA, by result (ok, refused, rate_limited, unavailable, error).",
		}, []string{"result"}),
		renewed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_cert_renewals_total",
			Help: "Renewals of this agent's own certificates through the cluster CA, by certificate (server, client) and result (ok, error).",
		}, []string{"cert", "result"}),
	}
	cfg.Registerer.MustRegister(c.signed, c.renewed)
	return c
}

// SignRenewal implements cluster.CertificateSigner: only the leader signs,
// at most csr_max_per_second (with csr_burst), with the CA in the state.
func (c *ClusterCA) SignRenewal(_ context.Context, req identity.RenewalRequest) ([]byte, error) {
	if !c.cfg.Ready() {
		c.signed.WithLabelValues("unavailable").Inc()
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("not the leader: only the leader signs renewals"))
	}
	if !c.limiter.Allow() {
		wait := time.Duration(float64(time.Second) / c.cfg.CA.CSRMaxPerSecond)
		c.signed.WithLabelValues("rate_limited").Inc()
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"renewals are limited to %g per second (tls.cluster_ca.csr_max_per_second); retry in %s", c.cfg.CA.CSRMaxPerSecond, wait.Round(time.Millisecond)))
	}
	ca, err := c.authority()
	if err != nil {
		c.signed.WithLabelValues("error").Inc()
		return nil, err
	}
	certPEM, issued, err := ca.Renew(req, c.cfg.Trust.VerifyChain, c.cfg.CA.LeafTTL.Std(), time.Now())
	if errors.Is(err, identity.ErrRenewalRefused) {
		c.signed.WithLabelValues("refused").Inc()
		c.cfg.Logger.Warn("certificate renewal refused", "error", err)
		return nil, connect.NewError(connect.CodePermissionDenied, err)
	}
	if err != nil {
		c.signed.WithLabelValues("error").Inc()
		c.cfg.Logger.Error("certificate renewal failed", "error", err)
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	c.signed.WithLabelValues("ok").Inc()
	c.cfg.Logger.Info("certificate renewed by the cluster CA", "subject", issued.Subject.String(),
		"serial", issued.SerialNumber.Text(16), "not_after", issued.NotAfter.UTC().Format(time.RFC3339))
	return certPEM, nil
}

// authority is the CA in the replicated state, parsed once per install.
func (c *ClusterCA) authority() (*identity.CertAuthority, error) {
	rec, err := c.cfg.FSM.State().ClusterCA()
	if err != nil {
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	if rec == nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New(
			"no cluster CA installed: set tls.cluster_ca.cert_file and key_file (e.g. PiCA.pem and PiCA.key) on a server node"))
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// Keyed by content, not index: a restored snapshot may carry another
	// CA installed at the same index.
	if c.cached != nil && bytes.Equal(c.cachedCert, rec.GetCertPem()) && bytes.Equal(c.cachedKey, rec.GetKeyPem()) {
		return c.cached, nil
	}
	ca, err := identity.ParseCertAuthority(rec.GetCertPem(), rec.GetKeyPem())
	if err != nil {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("the installed cluster CA: %w", err))
	}
	c.cached, c.cachedCert, c.cachedKey = ca, rec.GetCertPem(), rec.GetKeyPem()
	return ca, nil
}

// installLoop keeps the replicated state's cluster CA up to date with the
// configured files while this node leads (ctx: the leader term): at once,
// then every caCheckInterval, so a new intermediate in the files is
// picked up without a leader change; a failure is retried with backoff.
func (c *ClusterCA) installLoop(ctx context.Context) {
	if c.cfg.CA.CertFile == "" {
		return
	}
	var retry time.Duration
	for {
		wait := caCheckInterval
		if err := c.install(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			retry = min(max(2*retry, renewRetryMin), renewRetryMax)
			wait = retry
			c.cfg.Logger.Error("cluster CA not installed; retrying", "retry_in", retry, "error", err)
		} else {
			retry = 0
		}
		if !sleepCtx(ctx, wait) {
			return
		}
	}
}

// install puts the configured intermediate into the replicated state when
// the state holds none, or one that expires earlier. A broken file is an
// error; the CA in the state stays.
func (c *ClusterCA) install(ctx context.Context) error {
	certPEM, err := os.ReadFile(c.cfg.CA.CertFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file: %w", err)
	}
	keyPEM, err := os.ReadFile(c.cfg.CA.KeyFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.key_file: %w", err)
	}
	ca, err := identity.ParseCertAuthority(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca: %w", err)
	}
	if err := c.cfg.Trust.VerifyChain(ca.Chain, x509.ExtKeyUsageAny); err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file %s does not chain to tls.ca_file, so certificates it signs would not be trusted: %w", c.cfg.CA.CertFile, err)
	}
	if left := time.Until(ca.Cert.NotAfter); left < 2*c.cfg.CA.LeafTTL.Std() {
		c.cfg.Logger.Warn("the cluster CA expires soon: renewed certificates end with it; install a newer intermediate in tls.cluster_ca.cert_file",
			"subject", ca.Cert.Subject.String(), "not_after", ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	if rec, err := c.cfg.FSM.State().ClusterCA(); err == nil && rec != nil {
		if chain, err := identity.ParseCertificates(rec.GetCertPem()); err == nil {
			cur := chain[0]
			if bytes.Equal(cur.Raw, ca.Cert.Raw) {
				return nil
			}
			if !ca.Cert.NotAfter.After(cur.NotAfter) {
				return nil // the installed one lasts as long or longer
			}
		}
	}
	data, err := fsm.Encode(&fsmv1.Command{Time: timestamppb.Now(), Op: &fsmv1.Command_SetClusterCa{
		SetClusterCa: &fsmv1.SetClusterCA{CertPem: certPEM, KeyPem: keyPEM},
	}})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := resultErr(c.cfg.Proposer.Apply(ctx, data)); err != nil {
		return fmt.Errorf("propose the cluster CA: %w", err)
	}
	c.cfg.Logger.Info("cluster CA installed", "subject", ca.Cert.Subject.String(),
		"not_after", ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// RenewLoop renews the certificate of src (and reloads also, which reads
// the same files) at a random 60-90% of its lifetime, until ctx ends. A
// failed renewal is retried with backoff; the certificate in use stays.
func (c *ClusterCA) RenewLoop(ctx context.Context, name string, src *identity.Source, also ...*identity.Source) {
	r := &identity.Renewer{Name: name, Source: src, Also: also, CA: "the cluster CA", Ask: c.ask,
		Due: identity.RenewAtFraction, Logger: c.cfg.Logger, Result: func(name string, err error) {
			result := "ok"
			if err != nil {
				result = "error"
			}
			c.renewed.WithLabelValues(name, result).Inc()
		}}
	r.Run(ctx)
}

// ask sends a renewal to the leader: signed here when this node leads,
// else through the leader's internal port.
func (c *ClusterCA) ask(ctx context.Context, req identity.RenewalRequest) ([]byte, error) {
	id, raftAddr := c.cfg.Leader()
	switch {
	case id == "":
		return nil, errors.New("no leader to sign the renewal")
	case id == c.cfg.NodeID:
		return c.SignRenewal(ctx, req)
	}
	m, ok := c.cfg.Members.ServerByID(id, raftAddr)
	if !ok || m.Meta.InternalAddr == "" {
		return nil, fmt.Errorf("leader %s is not known to gossip yet", id)
	}
	resp, err := c.cfg.Node(m.Meta.InternalAddr).RenewCertificate(ctx, connect.NewRequest(&nodev1.RenewCertificateRequest{
		Csr: req.CSR, Current: req.Current, Proof: req.Proof,
	}))
	if err != nil {
		return nil, fmt.Errorf("leader %s: %w", m.Name, err)
	}
	return resp.Msg.GetCertPem(), nil
}

var _ cluster.CertificateSigner = (*ClusterCA)(nil)
