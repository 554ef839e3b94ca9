package devoidc

import (
	"crypto/subtle"
	"log/slog"
	"net/http"
	"strings"
	"sync"

	"golang.org/x/time/rate"
)

// Wrong secrets are limited for the whole issuer: failedPerSecond a
// second, failedBurst at once. Past that every attempt is refused, right or
// wrong, until the budget refills, so that the secret cannot be guessed at
// speed; each wrong one is logged.
const (
	failedPerSecond = 5
	failedBurst     = 20
)

// secrets is the issuer's budget of wrong secrets.
type secrets struct {
	once     sync.Once
	failures *rate.Limiter
	logged   *rate.Limiter
}

func (s *secrets) init() {
	s.once.Do(func() {
		s.failures = rate.NewLimiter(failedPerSecond, failedBurst)
		s.logged = rate.NewLimiter(1, 5)
	})
}

// secretVerdict is what checkSecret found.
type secretVerdict int

const (
	secretRight secretVerdict = iota
	secretWrong
	secretLimited // too many wrong ones lately: not even compared
)

// checkSecret compares a secret presented by the caller of r (what)
// with the issuer's, within the budget of wrong ones, and logs a wrong one
// or a refusal.
func (is *Issuer) checkSecret(r *http.Request, what, given string) secretVerdict {
	is.secrets.init()
	if is.secrets.failures.Tokens() < 1 {
		is.logRefusal(r, what, "too many wrong secrets lately: refused without comparing")
		return secretLimited
	}
	if is.secret != "" && subtle.ConstantTimeCompare([]byte(strings.TrimSpace(given)), []byte(is.secret)) == 1 {
		return secretRight
	}
	is.secrets.failures.Allow()
	is.logRefusal(r, what, "wrong secret")
	return secretWrong
}

func (is *Issuer) logRefusal(r *http.Request, what, reason string) {
	if !is.secrets.logged.Allow() {
		return
	}
	logger := is.Logger
	if logger == nil {
		logger = slog.Default()
	}
	logger.Warn("dev-issuer: refused", "what", what, "remote", r.RemoteAddr, "reason", reason)
}

// limitedAnswer is the text of a refusal past the budget.
const limitedAnswer = "too many wrong secrets lately; wait a few seconds"
