// Package caclient is the client side of the PiTrust CA server (pitrust
// serve) for the programs that renew certificates through it: the agent
// (tls.ca_server), pivirtd-sim (--ca-server) and pitrust itself.
package caclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"connectrpc.com/connect"

	"pilab.hu/pivirt-agent/identity"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// ServerName is the host of a CA server URL (https://host:port): the name
// its certificate must hold.
func ServerName(rawURL string) (string, error) {
	u, err := url.Parse(rawURL)
	if err != nil || u.Scheme != "https" || u.Host == "" {
		return "", fmt.Errorf("CA server URL %q: want https://host:port (e.g. https://pitrust.pivirt.internal:8080)", rawURL)
	}
	return u.Hostname(), nil
}

// New returns a client of the CA server at rawURL (https://host:port)
// over tlsConfig (which verifies the server, and presents a client
// certificate where the caller has one).
func New(rawURL string, tlsConfig *tls.Config) (pitrustv1connect.CertificateServiceClient, error) {
	if _, err := ServerName(rawURL); err != nil {
		return nil, err
	}
	tr := &http.Transport{
		TLSClientConfig:     tlsConfig,
		ForceAttemptHTTP2:   true,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		TLSHandshakeTimeout: 5 * time.Second,
		IdleConnTimeout:     90 * time.Second,
	}
	return pitrustv1connect.NewCertificateServiceClient(&http.Client{Transport: tr}, strings.TrimSuffix(rawURL, "/")), nil
}

// Asker asks the CA server at rawURL to renew: the RenewalAsker of an
// identity.Renewer.
func Asker(client pitrustv1connect.CertificateServiceClient, rawURL string) identity.RenewalAsker {
	return func(ctx context.Context, req identity.RenewalRequest) ([]byte, error) {
		resp, err := client.RenewCertificate(ctx, connect.NewRequest(&pitrustv1.RenewCertificateRequest{
			Csr: req.CSR, Current: req.Current, Proof: req.Proof,
		}))
		if err != nil {
			return nil, Explain(rawURL, err)
		}
		return resp.Msg.GetCertPem(), nil
	}
}

// Explain turns a CA server call's error into a sentence that says what
// to do.
func Explain(rawURL string, err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		return fmt.Errorf("the PiTrust CA server %s cannot be reached (is pitrust serve running, and server.addr reachable from here?): %w", rawURL, err)
	case connect.CodePermissionDenied:
		return fmt.Errorf("the PiTrust CA server %s refused: %w", rawURL, err)
	case connect.CodeResourceExhausted:
		return fmt.Errorf("the PiTrust CA server %s is rate limiting this caller; retrying later: %w", rawURL, err)
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Errorf("the PiTrust CA server %s: %w", rawURL, err)
	}
	return err
}
