// Package ratelimit holds the gateway's token buckets: one per key (a
// principal and a route), created on first use and forgotten once full
// again, so the number of buckets follows the callers actually active.
package ratelimit

import (
	"math"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// DefaultMaxKeys bounds the buckets kept at once.
const DefaultMaxKeys = 100_000

// Limiter rate-limits calls per key with token buckets (x/time/rate).
type Limiter struct {
	limit   rate.Limit
	burst   int
	maxKeys int
	now     func() time.Time

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
}

// New returns a limiter allowing perSecond calls per key with bursts of
// burst; maxKeys bounds the buckets (0: DefaultMaxKeys); now is the clock
// (nil: time.Now).
func New(perSecond float64, burst, maxKeys int, now func() time.Time) *Limiter {
	if maxKeys <= 0 {
		maxKeys = DefaultMaxKeys
	}
	if now == nil {
		now = time.Now
	}
	return &Limiter{limit: rate.Limit(perSecond), burst: burst, maxKeys: maxKeys, now: now, buckets: make(map[string]*rate.Limiter)}
}

// Allow takes a token of key's bucket; when there is none it returns false
// and how long until one is there (the retry hint).
func (l *Limiter) Allow(key string) (bool, time.Duration) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.buckets[key]
	if !ok {
		if len(l.buckets) >= l.maxKeys {
			l.forgetFull(now)
		}
		if len(l.buckets) >= l.maxKeys {
			// Every bucket is in use: a new key shares the fate of an
			// exhausted limiter rather than growing memory without bound.
			return false, time.Second
		}
		b = rate.NewLimiter(l.limit, l.burst)
		l.buckets[key] = b
	}
	r := b.ReserveN(now, 1)
	if !r.OK() {
		return false, time.Duration(math.MaxInt64)
	}
	if d := r.DelayFrom(now); d > 0 {
		r.CancelAt(now)
		return false, d
	}
	return true, 0
}

// forgetFull drops the buckets that refilled completely: forgetting them
// changes nothing for their keys.
func (l *Limiter) forgetFull(now time.Time) {
	for k, b := range l.buckets {
		if b.TokensAt(now) >= float64(l.burst) {
			delete(l.buckets, k)
		}
	}
}

// Len is the number of buckets kept.
func (l *Limiter) Len() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.buckets)
}
