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

// Budget is a token bucket per key whose tokens can be given back: a
// caller takes one before it does something that may fail, and gives it
// back when it did not, so that only failures spend the budget — and
// calls in flight at the same time each hold a token, so a burst of
// concurrent attempts cannot overdraw it (x/time/rate cannot return a
// token once its reservation is due, hence this small bucket of its own).
type Budget struct {
	perSecond float64
	burst     float64
	maxKeys   int
	now       func() time.Time

	mu      sync.Mutex
	buckets map[string]*budgetBucket
}

type budgetBucket struct {
	tokens float64
	at     time.Time
}

// NewBudget returns a budget of perSecond tokens a second per key, at most
// burst; maxKeys bounds the keys (0: DefaultMaxKeys); now is the clock
// (nil: time.Now).
func NewBudget(perSecond float64, burst, maxKeys int, now func() time.Time) *Budget {
	if maxKeys <= 0 {
		maxKeys = DefaultMaxKeys
	}
	if now == nil {
		now = time.Now
	}
	return &Budget{perSecond: perSecond, burst: float64(burst), maxKeys: maxKeys, now: now, buckets: make(map[string]*budgetBucket)}
}

// Take takes a token of key's budget; without one it returns false and
// how long until one is there.
func (b *Budget) Take(key string) (bool, time.Duration) {
	now := b.now()
	b.mu.Lock()
	defer b.mu.Unlock()
	bk := b.bucket(key, now)
	if bk == nil {
		return false, time.Second
	}
	if bk.tokens >= 1 {
		bk.tokens--
		return true, 0
	}
	return false, time.Duration((1 - bk.tokens) / b.perSecond * float64(time.Second))
}

// GiveBack returns a token taken from key's budget.
func (b *Budget) GiveBack(key string) {
	now := b.now()
	b.mu.Lock()
	defer b.mu.Unlock()
	if bk := b.bucket(key, now); bk != nil {
		bk.tokens = min(bk.tokens+1, b.burst)
	}
}

// bucket returns key's bucket refilled to now (nil: no room for a new
// key).
func (b *Budget) bucket(key string, now time.Time) *budgetBucket {
	bk, ok := b.buckets[key]
	if !ok {
		if len(b.buckets) >= b.maxKeys {
			for k, o := range b.buckets {
				if o.tokens+b.perSecond*now.Sub(o.at).Seconds() >= b.burst {
					delete(b.buckets, k)
				}
			}
		}
		if len(b.buckets) >= b.maxKeys {
			return nil
		}
		bk = &budgetBucket{tokens: b.burst, at: now}
		b.buckets[key] = bk
	}
	if el := now.Sub(bk.at).Seconds(); el > 0 {
		bk.tokens = min(bk.tokens+el*b.perSecond, b.burst)
	}
	bk.at = now
	return bk
}
