package identity

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
	"slices"
	"sync"
	"time"
)

// Renewal timing and backoff.
const (
	// RenewTimeout bounds one renewal round trip to the CA.
	RenewTimeout = 10 * time.Second
	// renewRetryMin and renewRetryMax bound the backoff between failed
	// renewals.
	renewRetryMin = time.Second
	renewRetryMax = time.Minute
	// renewRecheck is the longest a renewer sleeps before looking at its
	// certificate again (an operator may have replaced the files).
	renewRecheck = time.Minute
)

// RenewalAsker sends a renewal request to a CA and returns the new
// certificate (PEM, leaf first, its intermediates after).
type RenewalAsker func(ctx context.Context, req RenewalRequest) ([]byte, error)

// Renewer keeps the certificate of a Source renewed through a CA: when it
// is due (Due), it makes a new key, asks the CA (Ask) with a proof by the
// current key, checks the answer and installs it with Source.Replace;
// Also are reloaded after (other sources reading the same files). A
// failed renewal is retried with jittered exponential backoff (1 s to
// 1 min) and the certificate in use stays.
type Renewer struct {
	// Name names the certificate in logs and Result (server, client).
	Name   string
	Source *Source
	Also   []*Source
	// CA names the CA in messages (e.g. "the cluster CA", "the PiTrust CA
	// server https://pitrust:8080").
	CA  string
	Ask RenewalAsker
	// Due returns when a certificate is to be renewed; it is asked once
	// per certificate (its jitter is drawn then).
	Due    func(leaf *x509.Certificate) time.Time
	Logger *slog.Logger
	// Result, if set, is told of each attempt's outcome.
	Result func(name string, err error)

	mu     sync.Mutex
	status RenewalStatus
}

// RenewalStatus is what a Renewer reports for /ready and logs.
type RenewalStatus struct {
	// Next is when the next attempt is due; LastError the last attempt's
	// error (nil after a success); LastRenewed the last success.
	Next        time.Time
	LastError   error
	LastRenewed time.Time
}

// Status returns the Renewer's current status.
func (r *Renewer) Status() RenewalStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.status
}

func (r *Renewer) setStatus(f func(*RenewalStatus)) {
	r.mu.Lock()
	f(&r.status)
	r.mu.Unlock()
}

// RenewAtFraction renews at a random point between 60% and 90% of a
// certificate's lifetime (the cluster CA's short-lived certificates).
func RenewAtFraction(leaf *x509.Certificate) time.Time {
	return RenewalTime(leaf, 0.6+0.3*rand.Float64())
}

// RenewBeforeExpiry renews when before or less of a certificate's lifetime
// remains (at most a third of its lifetime, so a certificate shorter than
// 3×before is not renewed at once and again and again), less a random
// jitter of up to a tenth of that, so that the certificates issued
// together are not renewed together.
func RenewBeforeExpiry(before time.Duration) func(*x509.Certificate) time.Time {
	return func(leaf *x509.Certificate) time.Time {
		window := min(before, leaf.NotAfter.Sub(leaf.NotBefore)/3)
		jitter := time.Duration(0)
		if n := int64(window / 10); n > 0 {
			jitter = time.Duration(rand.Int64N(n))
		}
		return leaf.NotAfter.Add(-window - jitter)
	}
}

// Run renews the certificate until ctx ends.
func (r *Renewer) Run(ctx context.Context) {
	logger := r.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	var (
		serial string
		retry  time.Duration
		due    time.Time
	)
	for {
		leaf := r.Source.Leaf()
		if s := leaf.SerialNumber.String(); s != serial {
			// A new certificate (renewed, or replaced by an operator).
			serial, retry = s, 0
			due = r.Due(leaf)
			r.setStatus(func(st *RenewalStatus) { st.Next = due })
			logger.Info("certificate renewal scheduled", "cert", r.Name, "subject", leaf.Subject.String(), "ca", r.CA,
				"renew_at", due.UTC().Format(time.RFC3339), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339))
		}
		if wait := time.Until(due); wait > 0 {
			// Until it is due, a reload of the files (an operator replaced
			// them) or the recheck, whichever comes first.
			if !waitWake(ctx, min(wait, renewRecheck), r.Source.Loaded()) {
				return
			}
			continue
		}
		err := r.renew(ctx)
		if ctx.Err() != nil {
			return
		}
		if r.Result != nil {
			r.Result(r.Name, err)
		}
		if err == nil {
			r.setStatus(func(st *RenewalStatus) { st.LastError, st.LastRenewed = nil, time.Now() })
			continue
		}
		retry = min(max(2*retry, renewRetryMin), renewRetryMax)
		level := slog.LevelWarn
		if time.Now().After(leaf.NotAfter) {
			// Nothing renews an expired certificate: pitrust must.
			level = slog.LevelError
		}
		logger.Log(ctx, level, "certificate renewal failed; keeping the certificate in use", "cert", r.Name, "ca", r.CA,
			"subject", leaf.Subject.String(), "not_after", leaf.NotAfter.UTC().Format(time.RFC3339), "retry_in", retry, "error", err)
		// Jitter, so that nodes failing together do not retry together.
		due = time.Now().Add(retry/2 + rand.N(retry/2+1))
		r.setStatus(func(st *RenewalStatus) { st.LastError, st.Next = err, due })
	}
}

// renew asks the CA for a new certificate for the Source and installs it
// with its new key.
func (r *Renewer) renew(ctx context.Context) error {
	cur := r.Source.Certificate()
	key, ok := cur.PrivateKey.(crypto.Signer)
	if !ok {
		return fmt.Errorf("unsupported key type %T", cur.PrivateKey)
	}
	req, newKey, err := NewRenewalRequest(cur.Certificate, key)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, RenewTimeout)
	defer cancel()
	certPEM, err := r.Ask(ctx, req)
	if err != nil {
		return err
	}
	// The new certificate must be trusted by this node's own CAs, for
	// the same use, before it replaces the one in use.
	chain, err := ParseCertificates(certPEM)
	if err != nil {
		return fmt.Errorf("%s answered: %w", r.CA, err)
	}
	usage := x509.ExtKeyUsageClientAuth
	if len(chain[0].ExtKeyUsage) > 0 {
		usage = chain[0].ExtKeyUsage[0]
	}
	if err := r.Source.VerifyChain(chain, usage); err != nil {
		return fmt.Errorf("the renewed certificate is not trusted by the CA file in use: %w", err)
	}
	if old := cur.Leaf; old != nil && !sameNames(old, chain[0]) {
		return fmt.Errorf("%s answered a certificate for %s %v %v, not for %s %v %v", r.CA,
			chain[0].Subject, chain[0].DNSNames, chain[0].IPAddresses, old.Subject, old.DNSNames, old.IPAddresses)
	}
	keyPEM, err := KeyPEM(newKey)
	if err != nil {
		return err
	}
	if err := r.Source.Replace(certPEM, keyPEM, cur.Certificate[0]); err != nil {
		return err
	}
	var errs []error
	for _, s := range r.Also {
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

// waitWake waits d, until wake fires or ctx ends (false).
func waitWake(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
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
