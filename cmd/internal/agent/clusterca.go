package agent

import (
	"bytes"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/fsm"
	"pilab.hu/pivirt-agent/identity"
	fsmv1 "pilab.hu/pivirt-agent/proto/pivirt/fsm/v1"
	nodev1 "pilab.hu/pivirt-agent/proto/pivirt/node/v1"
)

const (
	// renewTimeout bounds one renewal round trip to the leader.
	renewTimeout = 10 * time.Second
	// renewRetryMin and renewRetryMax bound the backoff between failed
	// renewals.
	renewRetryMin = time.Second
	renewRetryMax = time.Minute
	// renewRecheck is the longest a renewer sleeps before looking at its
	// certificate again (an operator may have replaced the files).
	renewRecheck = time.Minute
	// caCheckInterval is how often the leader compares the configured
	// intermediate with the installed one.
	caCheckInterval = 10 * time.Minute
)

// clusterCA is the built-in cluster CA of an agent (tls.cluster_ca): on
// the leader it installs the configured intermediate into the replicated
// state and signs renewals; on every agent it renews the agent's own server
// and client certificates at a random 60-90% of their lifetime.
type clusterCA struct {
	a       *Agent
	cfg     config.ClusterCAConfig
	limiter *rate.Limiter
	// signed counts the renewals this node answered as leader, by result;
	// renewed the renewals of this node's own certificates.
	signed  *prometheus.CounterVec
	renewed *prometheus.CounterVec

	mu                    sync.Mutex
	cached                *identity.CertAuthority
	cachedCert, cachedKey []byte
}

func newClusterCA(a *Agent, cfg config.ClusterCAConfig) *clusterCA {
	c := &clusterCA{
		a:       a,
		cfg:     cfg,
		limiter: rate.NewLimiter(rate.Limit(cfg.CSRMaxPerSecond), cfg.CSRBurst),
		signed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_ca_signed_total",
			Help: "Certificate renewals answered by this node as the leader's cluster CA, by result (ok, refused, rate_limited, unavailable, error).",
		}, []string{"result"}),
		renewed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "pivirt_tls_cert_renewals_total",
			Help: "Renewals of this agent's own certificates through the cluster CA, by certificate (server, client) and result (ok, error).",
		}, []string{"cert", "result"}),
	}
	a.metrics.MustRegister(c.signed, c.renewed)
	return c
}

// SignRenewal implements cluster.CertificateSigner: only the leader signs,
// at most csr_max_per_second (with csr_burst), with the CA in the state.
func (c *clusterCA) SignRenewal(_ context.Context, req identity.RenewalRequest) ([]byte, error) {
	if !c.a.leaderReady() {
		c.signed.WithLabelValues("unavailable").Inc()
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("not the leader: only the leader signs renewals"))
	}
	if !c.limiter.Allow() {
		wait := time.Duration(float64(time.Second) / c.cfg.CSRMaxPerSecond)
		c.signed.WithLabelValues("rate_limited").Inc()
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"renewals are limited to %g per second (tls.cluster_ca.csr_max_per_second); retry in %s", c.cfg.CSRMaxPerSecond, wait.Round(time.Millisecond)))
	}
	ca, err := c.authority()
	if err != nil {
		c.signed.WithLabelValues("error").Inc()
		return nil, err
	}
	certPEM, issued, err := ca.Renew(req, c.a.tls.internal.VerifyChain, c.cfg.LeafTTL.Std(), time.Now())
	if errors.Is(err, identity.ErrRenewalRefused) {
		c.signed.WithLabelValues("refused").Inc()
		c.a.logger.Warn("certificate renewal refused", "error", err)
		return nil, connect.NewError(connect.CodePermissionDenied, err)
	}
	if err != nil {
		c.signed.WithLabelValues("error").Inc()
		c.a.logger.Error("certificate renewal failed", "error", err)
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	c.signed.WithLabelValues("ok").Inc()
	c.a.logger.Info("certificate renewed by the cluster CA", "subject", issued.Subject.String(),
		"serial", issued.SerialNumber.Text(16), "not_after", issued.NotAfter.UTC().Format(time.RFC3339))
	return certPEM, nil
}

// authority is the CA in the replicated state, parsed once per install.
func (c *clusterCA) authority() (*identity.CertAuthority, error) {
	rec, err := c.a.fsm.State().ClusterCA()
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
func (c *clusterCA) installLoop(ctx context.Context) {
	if c.cfg.CertFile == "" {
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
			c.a.logger.Error("cluster CA not installed; retrying", "retry_in", retry, "error", err)
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
func (c *clusterCA) install(ctx context.Context) error {
	certPEM, err := os.ReadFile(c.cfg.CertFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file: %w", err)
	}
	keyPEM, err := os.ReadFile(c.cfg.KeyFile)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca.key_file: %w", err)
	}
	ca, err := identity.ParseCertAuthority(certPEM, keyPEM)
	if err != nil {
		return fmt.Errorf("tls.cluster_ca: %w", err)
	}
	if err := c.a.tls.internal.VerifyChain(ca.Chain, x509.ExtKeyUsageAny); err != nil {
		return fmt.Errorf("tls.cluster_ca.cert_file %s does not chain to tls.ca_file, so certificates it signs would not be trusted: %w", c.cfg.CertFile, err)
	}
	if left := time.Until(ca.Cert.NotAfter); left < 2*c.cfg.LeafTTL.Std() {
		c.a.logger.Warn("the cluster CA expires soon: renewed certificates end with it; install a newer intermediate in tls.cluster_ca.cert_file",
			"subject", ca.Cert.Subject.String(), "not_after", ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	}
	if rec, err := c.a.fsm.State().ClusterCA(); err == nil && rec != nil {
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
	resp, _, err := c.a.store.Apply(ctx, data)
	if err == nil {
		if res, ok := resp.(*fsm.Result); ok && res.Err != nil {
			err = res.Err
		}
	}
	if err != nil {
		return fmt.Errorf("propose the cluster CA: %w", err)
	}
	c.a.logger.Info("cluster CA installed", "subject", ca.Cert.Subject.String(),
		"not_after", ca.Cert.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

// renewLoop renews the certificate of src (and reloads also, which reads
// the same files) at a random 60-90% of its lifetime, until ctx ends. A
// failed renewal is retried with backoff; the certificate in use stays.
func (c *clusterCA) renewLoop(ctx context.Context, name string, src *identity.Source, also ...*identity.Source) {
	var (
		serial   string
		fraction float64
		retry    time.Duration
		due      time.Time
	)
	for {
		leaf := src.Leaf()
		if s := leaf.SerialNumber.String(); s != serial {
			// A new certificate (renewed, or replaced by an operator).
			serial, fraction, retry = s, 0.6+0.3*rand.Float64(), 0
			due = identity.RenewalTime(leaf, fraction)
			c.a.logger.Info("certificate renewal scheduled", "cert", name, "subject", leaf.Subject.String(),
				"renew_at", due.UTC().Format(time.RFC3339), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
		}
		if wait := time.Until(due); wait > 0 {
			// Until it is due, a reload of the files (an operator replaced
			// them) or the recheck, whichever comes first.
			if !waitCtx(ctx, min(wait, renewRecheck), src.Loaded()) {
				return
			}
			continue
		}
		err := c.renew(ctx, src, also...)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			c.renewed.WithLabelValues(name, "ok").Inc()
			continue
		}
		c.renewed.WithLabelValues(name, "error").Inc()
		retry = min(max(2*retry, renewRetryMin), renewRetryMax)
		level := slog.LevelWarn
		if time.Now().After(leaf.NotAfter) {
			// Nothing renews an expired certificate: pitrust must.
			level = slog.LevelError
		}
		c.a.logger.Log(ctx, level, "certificate renewal failed; keeping the certificate in use", "cert", name,
			"subject", leaf.Subject.String(), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339), "retry_in", retry, "error", err)
		// Jitter, so that agents failing together do not retry together.
		due = time.Now().Add(retry/2 + rand.N(retry/2+1))
	}
}

// renew asks the leader's cluster CA for a new certificate for src and
// installs it with its new key.
func (c *clusterCA) renew(ctx context.Context, src *identity.Source, also ...*identity.Source) error {
	cur := src.Certificate()
	key, ok := cur.PrivateKey.(crypto.Signer)
	if !ok {
		return fmt.Errorf("unsupported key type %T", cur.PrivateKey)
	}
	req, newKey, err := identity.NewRenewalRequest(cur.Certificate, key)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, renewTimeout)
	defer cancel()
	certPEM, err := c.ask(ctx, req)
	if err != nil {
		return err
	}
	// The new certificate must be trusted by this node's own CAs, for
	// the same use, before it replaces the one in use.
	chain, err := identity.ParseCertificates(certPEM)
	if err != nil {
		return fmt.Errorf("the cluster CA answered: %w", err)
	}
	usage := x509.ExtKeyUsageClientAuth
	if len(chain[0].ExtKeyUsage) > 0 {
		usage = chain[0].ExtKeyUsage[0]
	}
	if err := src.VerifyChain(chain, usage); err != nil {
		return fmt.Errorf("the renewed certificate is not trusted by tls.ca_file: %w", err)
	}
	if old := cur.Leaf; old != nil && !sameNames(old, chain[0]) {
		return fmt.Errorf("the cluster CA answered a certificate for %s %v %v, not for %s %v %v",
			chain[0].Subject, chain[0].DNSNames, chain[0].IPAddresses, old.Subject, old.DNSNames, old.IPAddresses)
	}
	keyPEM, err := identity.KeyPEM(newKey)
	if err != nil {
		return err
	}
	if err := src.Replace(certPEM, keyPEM, cur.Certificate[0]); err != nil {
		return err
	}
	var errs []error
	for _, s := range also {
		errs = append(errs, s.Reload())
	}
	return errors.Join(errs...)
}

// sameNames reports whether two certificates have the same subject and
// names.
func sameNames(a, b *x509.Certificate) bool {
	return bytes.Equal(a.RawSubject, b.RawSubject) && slices.Equal(a.DNSNames, b.DNSNames) &&
		slices.EqualFunc(a.IPAddresses, b.IPAddresses, func(x, y net.IP) bool { return x.Equal(y) })
}

// ask sends a renewal to the leader: signed here when this node leads,
// else through the leader's internal port.
func (c *clusterCA) ask(ctx context.Context, req identity.RenewalRequest) ([]byte, error) {
	id, _ := c.a.raft.Leader()
	switch {
	case id == "":
		return nil, errors.New("no leader to sign the renewal")
	case id == c.a.nodeID:
		return c.SignRenewal(ctx, req)
	}
	m, ok := c.a.gossip.MemberByID(id)
	if !ok || m.Meta.InternalAddr == "" {
		return nil, fmt.Errorf("leader %s is not known to gossip yet", id)
	}
	resp, err := c.a.pool.Node(m.Meta.InternalAddr).RenewCertificate(ctx, connect.NewRequest(&nodev1.RenewCertificateRequest{
		Csr: req.CSR, Current: req.Current, Proof: req.Proof,
	}))
	if err != nil {
		return nil, fmt.Errorf("leader %s: %w", m.Name, err)
	}
	return resp.Msg.GetCertPem(), nil
}

// sleepCtx waits d; false when ctx ended first.
func sleepCtx(ctx context.Context, d time.Duration) bool { return waitCtx(ctx, d, nil) }

// waitCtx waits d, or until wake is closed; false when ctx ended first.
func waitCtx(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	case <-wake:
		return true
	}
}
