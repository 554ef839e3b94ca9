package operator

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pilab.hu/pivirt-agent/cmd/internal/caclient"
	"pilab.hu/pivirt-agent/identity"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// credentials are the operator's own client certificate for the CA
// server: files (--cert, --key, reread when they change, e.g. a mounted
// Secret updated in place), or a certificate got once with a bootstrap
// token and kept in a Secret of the operator's namespace, which the leader
// renews at two thirds of its life.
type credentials struct {
	mu  sync.Mutex
	cur *tls.Certificate

	// files
	src *identity.Source

	// bootstrap token
	tokenFile string
	secret    types.NamespacedName
	caURL     string
	bundle    []byte
	kube      client.Client
	reader    client.Reader
	logger    *slog.Logger
}

// certificate is the certificate to present (an empty one when there is
// none yet: the CA server then answers Unauthenticated, which says so).
func (c *credentials) certificate() *tls.Certificate {
	if c == nil {
		return &tls.Certificate{}
	}
	if c.src != nil {
		if cert := c.src.Certificate(); cert != nil {
			return cert
		}
		return &tls.Certificate{}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		return &tls.Certificate{}
	}
	return c.cur
}

// ready says why there is no certificate to present yet (nil: there is
// one, or the operator has none configured and the CA server will say).
func (c *credentials) ready() error {
	if c == nil || c.tokenFile == "" {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.cur == nil {
		return fmt.Errorf("the operator has no certificate yet: it redeems its bootstrap token (--bootstrap-token-file) and keeps the certificate in Secret %s", c.secret)
	}
	return nil
}

// Keys of the credentials Secret.
const (
	credCertKey = corev1.TLSCertKey
	credKeyKey  = corev1.TLSPrivateKeyKey
	credNextKey = "next.key"
)

// Start runs while this replica leads (a manager.Runnable that needs
// leader election): it loads the credential from its Secret, gets one
// with the bootstrap token when there is none, and renews it at two thirds
// of its life. Only the leader renews, so that two replicas never spend
// the one renewal a certificate has.
func (c *credentials) Start(ctx context.Context) error {
	if c.src != nil || c.tokenFile == "" {
		<-ctx.Done()
		return nil
	}
	retry := time.Second
	for {
		next, err := c.ensure(ctx)
		if err != nil {
			c.logger.Warn("operator credential", "secret", c.secret.String(), "error", err, "retry_in", retry)
			next = time.Now().Add(retry)
			retry = min(2*retry, time.Minute)
		} else {
			retry = time.Second
		}
		t := time.NewTimer(time.Until(next))
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}

// ensure makes sure the credential is valid and returns when to look
// again.
func (c *credentials) ensure(ctx context.Context) (time.Time, error) {
	var s corev1.Secret
	err := c.reader.Get(ctx, c.secret, &s)
	switch {
	case apierrors.IsNotFound(err):
		return c.bootstrap(ctx, nil)
	case err != nil:
		return time.Time{}, fmt.Errorf("read Secret %s: %w", c.secret, err)
	case len(s.Data[credCertKey]) == 0 && len(s.Data[credNextKey]) > 0:
		// A bootstrap that kept its key and got no answer: again, with
		// that key.
		return c.bootstrap(ctx, &s)
	}
	cert, err := tls.X509KeyPair(s.Data[credCertKey], s.Data[credKeyKey])
	if err != nil {
		return time.Time{}, fmt.Errorf("the Secret %s does not hold a certificate and its key (delete it to bootstrap again with a new token): %w", c.secret, err)
	}
	leaf := cert.Leaf
	if time.Now().After(leaf.NotAfter) {
		return time.Time{}, fmt.Errorf("the operator's certificate in Secret %s expired on %s: nothing can renew it; delete the Secret and give the operator a new bootstrap token", c.secret, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	c.mu.Lock()
	c.cur = &cert
	c.mu.Unlock()
	due := identity.RenewalTime(leaf, 2.0/3)
	if time.Now().Before(due) {
		return due, nil
	}
	return c.renew(ctx, &s, &cert)
}

// bootstrap redeems the token for the operator's certificate and keeps it
// in the Secret; pending is a Secret holding the key of an earlier attempt.
func (c *credentials) bootstrap(ctx context.Context, pending *corev1.Secret) (time.Time, error) {
	b, err := os.ReadFile(c.tokenFile)
	if err != nil {
		return time.Time{}, fmt.Errorf("--bootstrap-token-file: %w", err)
	}
	token := strings.TrimSpace(string(b))
	var key crypto.Signer
	if pending != nil {
		if key, err = identity.ParsePrivateKeyPEM(pending.Data[credNextKey]); err != nil {
			return time.Time{}, fmt.Errorf("the Secret %s holds a key that does not parse (delete it to bootstrap again): %w", c.secret, err)
		}
	} else {
		if key, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
			return time.Time{}, err
		}
		// The key is kept before the token is spent, so that a Secret
		// that cannot be written costs no token, and an answer lost is
		// asked again with the same key.
		keyPEM, err := identity.KeyPEM(key)
		if err != nil {
			return time.Time{}, err
		}
		pending = &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Namespace: c.secret.Namespace, Name: c.secret.Name, Labels: map[string]string{"app.kubernetes.io/name": "pitrust-operator"}},
			Type:       corev1.SecretTypeOpaque, Data: map[string][]byte{credNextKey: keyPEM},
		}
		if err := c.kube.Create(ctx, pending); err != nil {
			return time.Time{}, fmt.Errorf("keep the operator's key in Secret %s before redeeming the token: %w", c.secret, err)
		}
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{}, key)
	if err != nil {
		return time.Time{}, err
	}
	cl, err := c.client()
	if err != nil {
		return time.Time{}, err
	}
	resp, err := cl.IssueCertificate(ctx, connect.NewRequest(&pitrustv1.IssueCertificateRequest{Csr: csr, BootstrapToken: token}))
	if err != nil {
		if connect.CodeOf(err) == connect.CodeUnauthenticated {
			return time.Time{}, fmt.Errorf("the bootstrap token of %s was refused (unknown, used or expired): create a new one with pitrust token create and update the file: %w", c.tokenFile, err)
		}
		return time.Time{}, caclient.Explain(c.caURL, err)
	}
	return c.store(ctx, pending, resp.Msg.GetCertPem(), key)
}

// renew renews the credential with a proof of its key. The new key is
// kept in the Secret (next.key) before the CA is asked: a certificate
// renews once, so an answer lost with its key would strand the operator;
// asked again with the same key, the CA answers the same certificate.
func (c *credentials) renew(ctx context.Context, s *corev1.Secret, cert *tls.Certificate) (time.Time, error) {
	key, ok := cert.PrivateKey.(crypto.Signer)
	if !ok {
		return time.Time{}, fmt.Errorf("key of type %T", cert.PrivateKey)
	}
	newKey, err := identity.ParsePrivateKeyPEM(s.Data[credNextKey])
	if err != nil {
		if newKey, err = ecdsa.GenerateKey(elliptic.P256(), rand.Reader); err != nil {
			return time.Time{}, err
		}
		keyPEM, err := identity.KeyPEM(newKey)
		if err != nil {
			return time.Time{}, err
		}
		s.Data[credNextKey] = keyPEM
		if err := c.kube.Update(ctx, s); err != nil {
			return time.Time{}, fmt.Errorf("keep the next key in Secret %s before renewing: %w", c.secret, err)
		}
	}
	req, _, err := identity.NewRenewalRequestFor(cert.Certificate, key, newKey)
	if err != nil {
		return time.Time{}, err
	}
	cl, err := c.client()
	if err != nil {
		return time.Time{}, err
	}
	certPEM, err := caclient.Asker(cl, c.caURL)(ctx, req)
	if err != nil {
		return time.Time{}, err
	}
	return c.store(ctx, s, certPEM, newKey)
}

// store writes the certificate and key to the Secret (created when s is
// nil, else updated at its resource version) and uses them.
func (c *credentials) store(ctx context.Context, s *corev1.Secret, certPEM []byte, key crypto.Signer) (time.Time, error) {
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		return time.Time{}, err
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return time.Time{}, fmt.Errorf("the CA server answered a certificate that does not fit the key: %w", err)
	}
	s.Data = map[string][]byte{credCertKey: certPEM, credKeyKey: keyPEM}
	if err := c.kube.Update(ctx, s); err != nil {
		return time.Time{}, fmt.Errorf("keep the operator's certificate in Secret %s (it is not used until it is kept): %w", c.secret, err)
	}
	c.mu.Lock()
	c.cur = &cert
	c.mu.Unlock()
	c.logger.Info("operator credential", "secret", c.secret.String(), "subject", cert.Leaf.Subject.String(),
		"serial", identity.SerialHex(cert.Leaf.SerialNumber), "not_after", cert.Leaf.NotAfter.UTC().Format(time.RFC3339))
	// A little jitter so that renewals of replicas started together spread.
	due := identity.RenewalTime(cert.Leaf, 2.0/3).Add(time.Duration(mrand.Int64N(int64(time.Minute))))
	return due, nil
}

// client reaches the default CA server with the current credential.
func (c *credentials) client() (pitrustv1connect.CertificateServiceClient, error) {
	host, err := caclient.ServerName(c.caURL)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(c.bundle) {
		return nil, errors.New("--ca-bundle holds no PEM certificate")
	}
	return caclient.New(c.caURL, &tls.Config{MinVersion: tls.VersionTLS12, ServerName: host, RootCAs: pool,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return c.certificate(), nil }})
}
