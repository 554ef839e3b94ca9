package caserver

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"time"

	"pilab.hu/pivirt-agent/identity"
)

// Renewal of the server's own certificate.
const (
	// selfRenewFraction is when, in its lifetime, the server renews its
	// own certificate.
	selfRenewFraction = 2.0 / 3
	// selfRenewInterval is how often it looks.
	selfRenewInterval = time.Hour
)

// renewOwnLoop renews the server's own certificate when it is due, until
// ctx ends.
func (s *Server) renewOwnLoop(ctx context.Context) {
	t := time.NewTicker(selfRenewInterval)
	defer t.Stop()
	for {
		if _, err := s.renewOwn(); err != nil {
			s.logger.Error("renewal of the server's own certificate failed; retrying in an hour", "error", err)
		}
		s.renewPasses.Add(1)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// renewOwn renews the server's certificate, as any holder does (a proof
// of its key, RenewCertificate's checks, recorded as a renewal), when it
// was issued by this CA and two thirds of its lifetime have passed; the
// new pair replaces the files (identity.Source.Replace: not if they were
// changed by hand meanwhile). A certificate from elsewhere is left to its
// owner. It reports whether it renewed.
func (s *Server) renewOwn() (bool, error) {
	s.renewMu.Lock()
	defer s.renewMu.Unlock()
	leaf := s.src.Leaf()
	pair := s.src.Certificate()
	if leaf == nil || pair == nil || leaf.CheckSignatureFrom(s.ca.Intermediate()) != nil {
		return false, nil
	}
	if s.now().Before(identity.RenewalTime(leaf, selfRenewFraction)) {
		return false, nil
	}
	key, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return false, errors.New("the server's key cannot sign")
	}
	req, newKey, err := identity.NewRenewalRequest([][]byte{leaf.Raw}, key)
	if err != nil {
		return false, err
	}
	certPEM, rec, err := s.ca.Renew(req)
	if err != nil {
		return false, fmt.Errorf("renew %s: %w (issue a new one with pitrust issue-mtls-server, or remove both files and restart)", s.certFile, err)
	}
	keyPEM, err := identity.KeyPEM(newKey)
	if err != nil {
		return false, err
	}
	if err := s.src.Replace(certPEM, keyPEM, leaf.Raw); err != nil {
		return false, err
	}
	s.logger.Info("renewed the server's own certificate", "cert", s.certFile, "serial", rec.Serial,
		"not_after", rec.NotAfter.UTC().Format(time.RFC3339))
	return true, nil
}

func (s *Server) now() time.Time {
	if s.cfg.Now != nil {
		return s.cfg.Now()
	}
	return time.Now()
}
