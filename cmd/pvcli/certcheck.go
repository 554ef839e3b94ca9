package main

import (
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

// tlsRefusal reports whether err is the agent refusing the TLS handshake
// because of the client certificate: an alert the server sent (bad or
// unknown certificate, an expired or revoked one, none given when one is
// required).
func tlsRefusal(err error) bool {
	if err == nil {
		return false
	}
	msg := err.Error()
	for _, alert := range []string{"remote error: tls: bad certificate", "remote error: tls: certificate required",
		"remote error: tls: unknown certificate authority", "remote error: tls: expired certificate",
		"remote error: tls: certificate revoked", "remote error: tls: unsupported certificate", "remote error: tls: handshake failure"} {
		if strings.Contains(msg, alert) {
			return true
		}
	}
	return false
}

// explainCertRefusal says, after the agent refused the TLS handshake,
// what pvcli can check of its own client certificate: whether one was
// sent, its validity period, its key usage, and whether the CA file
// pvcli trusts (the cluster's chain, which the agents trust too) issued
// it. The agent's log names its own reason.
func explainCertRefusal(w io.Writer, opts tlsOptions, now time.Time) {
	if opts.certFile == "" {
		fmt.Fprintf(w, "The agent refused the TLS handshake and pvcli sent no client certificate: the agent requires one (tls.require_client_cert). Give --cert-file/--key-file (%s/%s), or put one at %s and %s.\n",
			envCertFile, envKeyFile, defaultCertFile, defaultKeyFile)
		return
	}
	cert, found, err := certProblems(opts, now)
	if err != nil {
		fmt.Fprintf(w, "The agent refused the client certificate %s, which pvcli cannot read back: %v.\n", opts.certFile, err)
		return
	}
	fmt.Fprintf(w, "The agent refused the client certificate %s (subject %q, issuer %q).", opts.certFile, cert.Subject.String(), cert.Issuer.String())
	if len(found) == 0 {
		fmt.Fprintln(w, " pvcli finds nothing wrong with it here (valid now, for client authentication, issued by the CA file's chain): the agent may trust another chain, or have it revoked; its log says why (the TLS handshake error with your address).")
		return
	}
	fmt.Fprintln(w, " Checked here:")
	for _, f := range found {
		fmt.Fprintf(w, "  - %s\n", f)
	}
}

// certProblems is what pvcli finds wrong with its client certificate
// (opts.certFile, which must be set) by itself: its validity period, its
// key usage, whether the CA file's chain issued it.
func certProblems(opts tlsOptions, now time.Time) (*x509.Certificate, []string, error) {
	cert, err := readCertificate(opts.certFile)
	if err != nil {
		return nil, nil, err
	}
	var found []string
	switch {
	case now.After(cert.NotAfter):
		found = append(found, fmt.Sprintf("it expired on %s; issue a new one (pitrust issue-mtls-client)", cert.NotAfter.UTC().Format(time.RFC3339)))
	case now.Before(cert.NotBefore):
		found = append(found, fmt.Sprintf("it is not valid before %s (is this machine's clock right?)", cert.NotBefore.UTC().Format(time.RFC3339)))
	}
	if len(cert.ExtKeyUsage) > 0 && !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageClientAuth) && !slices.Contains(cert.ExtKeyUsage, x509.ExtKeyUsageAny) {
		found = append(found, "its extended key usage does not include client authentication (a server certificate?); issue a client one (pitrust issue-mtls-client) or one for both (--usage server,client)")
	}
	if opts.caFile != "" {
		if pemBytes, err := os.ReadFile(opts.caFile); err == nil {
			roots := x509.NewCertPool()
			if roots.AppendCertsFromPEM(pemBytes) {
				inter := x509.NewCertPool()
				for _, c := range chainOf(opts.certFile) {
					inter.AddCert(c)
				}
				_, verr := cert.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now,
					KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
				if verr != nil && now.Before(cert.NotAfter) && !now.Before(cert.NotBefore) {
					found = append(found, fmt.Sprintf("it does not chain to a CA of %s (issuer %q): %v", opts.caFile, cert.Issuer.String(), verr))
				}
			}
		}
	}
	return cert, found, nil
}

// explainUnclearFailure follows a call that failed without an answer of
// the agent and without a TLS alert pvcli could read — with TLS 1.3 the
// agent checks the client certificate after pvcli's handshake is done,
// and its refusal can arrive as a broken pipe or a closed connection
// instead: when pvcli's own certificate has a problem the agent would
// refuse, it is said.
func explainUnclearFailure(w io.Writer, opts tlsOptions, now time.Time) {
	if opts.certFile == "" {
		return
	}
	cert, found, err := certProblems(opts, now)
	if err != nil || len(found) == 0 {
		return
	}
	fmt.Fprintf(w, "The connection failed before the agent answered; the agent may have refused pvcli's client certificate %s (subject %q, issuer %q). Checked here:\n",
		opts.certFile, cert.Subject.String(), cert.Issuer.String())
	for _, f := range found {
		fmt.Fprintf(w, "  - %s\n", f)
	}
}

// readCertificate is the first certificate of a PEM file.
func readCertificate(file string) (*x509.Certificate, error) {
	chain := chainOf(file)
	if len(chain) == 0 {
		return nil, fmt.Errorf("no PEM certificate in it")
	}
	return chain[0], nil
}

// chainOf is every certificate of a PEM file (a leaf and, as pitrust
// writes it, its intermediate).
func chainOf(file string) []*x509.Certificate {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil
	}
	var out []*x509.Certificate
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return out
		}
		if block.Type != "CERTIFICATE" {
			continue
		}
		if c, err := x509.ParseCertificate(block.Bytes); err == nil {
			out = append(out, c)
		}
	}
}
