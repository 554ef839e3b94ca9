package operator

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllerutil"
	"sigs.k8s.io/controller-runtime/pkg/reconcile"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
)

// Names the operator writes on Secrets and resources.
const (
	// caKey is the Secret's key of the CA chain (the intermediate and the
	// root), as cert-manager names it.
	caKey = "ca.crt"

	// labelCertificate marks a Secret as a ManagedCertificate's (its
	// name); the operator's Secret cache holds only such Secrets.
	labelCertificate = "certz.pilab.hu/certificate-name"

	annotationSpecHash = "certz.pilab.hu/spec-hash"
	annotationRevision = "certz.pilab.hu/revision"
	annotationSerial   = "certz.pilab.hu/serial"
	annotationIssuer   = "certz.pilab.hu/issuer"
	// annotationRenew on a resource asks for a new certificate (and key)
	// now: any value not yet handled, as the Secret's copy of it says
	// (kubectl annotate … certz.pilab.hu/renew=$(date +%s) --overwrite).
	annotationRenew = "certz.pilab.hu/renew"

	// finalizer holds a deleted resource until its certificate is revoked.
	finalizer = "certz.pilab.hu/revoke"

	// recheck is the longest a valid certificate goes without a look.
	recheck = time.Hour

	// Reasons of the Issuing condition that leave the Secret's
	// certificate in service while a new one is made.
	reasonRenewing         = "Renewing"
	reasonRenewalRequested = "RenewalRequested"
)

// eventRecorder is what the reconciler needs of an events recorder
// (events.k8s.io/v1).
type eventRecorder interface {
	Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...any)
}

// Reconciler keeps each ManagedCertificate's Secret holding a valid
// certificate of its spec.
type Reconciler struct {
	// Client writes; Reader reads uncached (the resource and its Secret
	// are read fresh at each reconcile, so that a stale cache can never
	// make a second issuance).
	Client  client.Client
	Reader  client.Reader
	Issuers *issuers
	Policy  *Policy
	Events  eventRecorder
	Metrics *metrics
	Logger  *slog.Logger
	// RevocationDelay is how long a replaced certificate stays valid, so
	// that pods take up the new Secret first.
	RevocationDelay time.Duration
	RetryMin        time.Duration
	RetryMax        time.Duration
	Now             func() time.Time
}

// Reconcile brings one ManagedCertificate's Secret in line.
func (r *Reconciler) Reconcile(ctx context.Context, req reconcile.Request) (reconcile.Result, error) {
	mc := &v1alpha1.ManagedCertificate{}
	if err := r.Reader.Get(ctx, req.NamespacedName, mc); err != nil {
		if apierrors.IsNotFound(err) {
			r.Metrics.forget(req.Namespace, req.Name)
			return reconcile.Result{}, nil
		}
		return reconcile.Result{}, err
	}
	if !mc.DeletionTimestamp.IsZero() {
		return r.finalize(ctx, mc)
	}
	if !controllerutil.ContainsFinalizer(mc, finalizer) {
		patch := client.MergeFrom(mc.DeepCopy())
		controllerutil.AddFinalizer(mc, finalizer)
		if err := r.Client.Patch(ctx, mc, patch); err != nil {
			return reconcile.Result{}, err
		}
	}
	orig := mc.Status.DeepCopy()
	now := r.Now()
	w, err := wantedOf(mc)
	if err != nil {
		return r.fail(ctx, mc, false, &issuerError{ReasonInvalidSpec, err})
	}
	ref := mc.Spec.Issuer()
	if err := r.Policy.Allows(mc.Namespace, w, ref, r.Issuers.defaultURL); err != nil {
		return r.fail(ctx, mc, false, &issuerError{ReasonPolicyDenied, err})
	}
	secret, err := r.secret(ctx, mc)
	if err != nil {
		return r.fail(ctx, mc, false, err)
	}
	specHash := w.hash(ref)
	cur, reason, message := inspect(secret, w, specHash, now, r.Issuers.trust(ctx, mc.Namespace, ref), mc.UID)
	if want := mc.Annotations[annotationRenew]; reason == "" && want != "" && want != secret.Annotations[annotationRenew] {
		reason, message = reasonRenewalRequested, fmt.Sprintf("a renewal was requested (annotation %s=%s)", annotationRenew, want)
	}
	valid := reason == "" || reason == reasonRenewing || reason == reasonRenewalRequested
	if reason == "" {
		if err := r.keepSecretMeta(ctx, mc, secret); err != nil {
			return reconcile.Result{}, err
		}
		r.revokeDue(ctx, mc, now)
		return r.ready(ctx, mc, orig, w, secret, cur, now)
	}
	iss, err := r.Issuers.forRef(ctx, mc.Namespace, ref)
	if err != nil {
		return r.fail(ctx, mc, valid, err)
	}
	log := r.Logger.With("namespace", mc.Namespace, "name", mc.Name)
	log.Info("issuing", "reason", reason, "detail", message)
	if !meta.IsStatusConditionTrue(mc.Status.Conditions, v1alpha1.ConditionIssuing) {
		// Say so before the CA is asked: the write also fails if another
		// writer changed the resource meanwhile.
		meta.SetStatusCondition(&mc.Status.Conditions, metav1.Condition{
			Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionTrue, Reason: reason, Message: message, ObservedGeneration: mc.Generation,
		})
		if err := r.Client.Status().Update(ctx, mc); err != nil {
			return reconcile.Result{}, err
		}
	}
	var key crypto.Signer
	if w.rotation == v1alpha1.RotationNever && cur.key != nil && w.fitsKey(cur.key.Public()) && reason != reasonRenewalRequested {
		key = cur.key
	} else if key, err = w.newKey(); err != nil {
		return reconcile.Result{}, err
	}
	ctxIssue, cancel := context.WithTimeout(ctx, 30*time.Second)
	out, err := iss.issue(ctxIssue, request{
		Name: w.name, Kind: w.kind, Usages: w.usages, DNS: w.dns, IPs: w.ips, Cluster: w.cluster, Lifetime: w.duration, Key: key,
	})
	cancel()
	if err != nil {
		return r.fail(ctx, mc, valid, err)
	}
	serial := identity.SerialHex(out.Leaf.SerialNumber)
	// A CA server that does not know the lifetime field grants days: a
	// certificate that is not the spec's duration is not handed out.
	if granted := out.Leaf.NotAfter.Sub(now); granted > w.duration+2*time.Minute || granted < w.duration-2*time.Minute {
		r.revoke(ctx, mc, iss, serial, "superseded", "the lifetime granted is not the spec's")
		return r.fail(ctx, mc, valid, &issuerError{ReasonIssuerRefused, fmt.Errorf("%s granted a certificate valid until %s, not for the spec's duration %s (a CA server older than the operator grants whole days: upgrade it)",
			iss, out.Leaf.NotAfter.UTC().Format(time.RFC3339), w.duration)})
	}
	revision := mc.Status.Revision
	if secret != nil {
		if n, err := strconv.ParseInt(secret.Annotations[annotationRevision], 10, 64); err == nil {
			revision = max(revision, n)
		}
	}
	revision++
	keyPEM, err := identity.KeyPEM(key)
	if err != nil {
		return reconcile.Result{}, err
	}
	desired, err := r.desiredSecret(mc, secret)
	if err != nil {
		return r.fail(ctx, mc, valid, err)
	}
	desired.Data = map[string][]byte{corev1.TLSCertKey: out.ChainPEM, corev1.TLSPrivateKeyKey: keyPEM, caKey: out.CAPEM}
	desired.Annotations[annotationSpecHash] = specHash
	desired.Annotations[annotationRevision] = strconv.FormatInt(revision, 10)
	desired.Annotations[annotationSerial] = serial
	desired.Annotations[annotationIssuer] = iss.String()
	if want := mc.Annotations[annotationRenew]; want != "" {
		desired.Annotations[annotationRenew] = want
	}
	if err := r.writeSecret(ctx, secret, desired); err != nil {
		if definitelyNotWritten(err) {
			// Not handed out: revoked, so that nothing unaccounted for
			// stays valid. An error that may hide a write (a timeout)
			// leaves it to the next reconcile, which reads the Secret.
			r.revoke(ctx, mc, iss, serial, "superseded", "the Secret could not be written")
		}
		return reconcile.Result{}, fmt.Errorf("write Secret %s/%s: %w", mc.Namespace, mc.Spec.SecretName, err)
	}
	r.Metrics.issued(mc.Namespace, mc.Name)
	r.Events.Eventf(mc, nil, corev1.EventTypeNormal, "Issued", "Issue",
		"Issued certificate serial %s by %s, valid until %s, in Secret %s (revision %d; %s)", serial, iss, out.Leaf.NotAfter.UTC().Format(time.RFC3339), mc.Spec.SecretName, revision, message)
	log.Info("issued", "serial", serial, "not_after", out.Leaf.NotAfter.UTC().Format(time.RFC3339), "revision", revision, "secret", mc.Spec.SecretName)
	// The certificate replaced — the one this resource's status says it
	// issued, never whatever a tampered Secret holds — is revoked when the
	// policy says, after the delay that lets pods take up the new one.
	if prev := mc.Status.SerialNumber; prev != "" && prev != serial {
		scheduled := reason == reasonRenewing
		if w.revocation == v1alpha1.RevokeOnRenewal || (w.revocation == v1alpha1.RevokeOnDelete && !scheduled) {
			mc.Status.PendingRevocations = appendPending(mc.Status.PendingRevocations, v1alpha1.PendingRevocation{
				SerialNumber: prev, Reason: "superseded", RevokeAfter: metav1.Time{Time: now.Add(r.RevocationDelay)},
			})
		}
	}
	mc.Status.Revision = revision
	r.revokeDue(ctx, mc, now)
	return r.ready(ctx, mc, orig, w, desired, current{leaf: out.Leaf, key: key, serial: serial}, now)
}

// definitelyNotWritten reports whether a failed write surely changed
// nothing.
func definitelyNotWritten(err error) bool {
	return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err) || apierrors.IsInvalid(err) ||
		apierrors.IsForbidden(err) || apierrors.IsNotFound(err) || apierrors.IsBadRequest(err)
}

// ready records a valid certificate in the status and metrics, and asks
// to be called again at its renewal time (or a pending revocation's).
func (r *Reconciler) ready(ctx context.Context, mc *v1alpha1.ManagedCertificate, before *v1alpha1.ManagedCertificateStatus, w wanted, secret *corev1.Secret, cur current, now time.Time) (reconcile.Result, error) {
	renewal := w.renewalTime(cur.leaf)
	st := &mc.Status
	st.NotBefore = &metav1.Time{Time: cur.leaf.NotBefore}
	st.NotAfter = &metav1.Time{Time: cur.leaf.NotAfter}
	st.RenewalTime = &metav1.Time{Time: renewal}
	st.SerialNumber = cur.serial
	if n, err := strconv.ParseInt(secret.Annotations[annotationRevision], 10, 64); err == nil {
		st.Revision = n
	}
	st.ObservedGeneration = mc.Generation
	st.FailedIssuanceAttempts = 0
	st.LastFailureTime = nil
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionReady, Status: metav1.ConditionTrue, Reason: "Ready", ObservedGeneration: mc.Generation,
		Message: fmt.Sprintf("Secret %s holds certificate serial %s, valid until %s", mc.Spec.SecretName, cur.serial, cur.leaf.NotAfter.UTC().Format(time.RFC3339)),
	})
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionFalse, Reason: "UpToDate", ObservedGeneration: mc.Generation,
		Message: "renewal at " + renewal.UTC().Format(time.RFC3339),
	})
	if !statusEqual(before, st) {
		if err := r.Client.Status().Update(ctx, mc); err != nil {
			return reconcile.Result{}, err
		}
	}
	r.Metrics.ready(mc.Namespace, mc.Name, true, cur.leaf.NotAfter, renewal)
	next := renewal
	for _, p := range st.PendingRevocations {
		if p.RevokeAfter.Time.Before(next) {
			next = p.RevokeAfter.Time
		}
	}
	return reconcile.Result{RequeueAfter: min(max(next.Sub(now), time.Second), recheck)}, nil
}

// fail records a failed attempt (Ready=False unless the Secret still holds
// a valid certificate of the spec: valid) and retries with backoff.
func (r *Reconciler) fail(ctx context.Context, mc *v1alpha1.ManagedCertificate, valid bool, cause error) (reconcile.Result, error) {
	reason := reasonOf(cause)
	r.Metrics.issuanceError(mc.Namespace, mc.Name, reason)
	now := r.Now()
	st := &mc.Status
	st.FailedIssuanceAttempts++
	st.LastFailureTime = &metav1.Time{Time: now}
	st.ObservedGeneration = mc.Generation
	if !valid {
		meta.SetStatusCondition(&st.Conditions, metav1.Condition{
			Type: v1alpha1.ConditionReady, Status: metav1.ConditionFalse, Reason: reason, Message: cause.Error(), ObservedGeneration: mc.Generation,
		})
		r.Metrics.ready(mc.Namespace, mc.Name, false, notAfterOf(st), renewalOf(st))
	}
	delay := r.RetryMin
	for i := 1; i < st.FailedIssuanceAttempts && delay < r.RetryMax; i++ {
		delay *= 2
	}
	delay = min(delay, r.RetryMax)
	delay = delay/2 + rand.N(delay/2+1) // jitter: failures together do not retry together
	meta.SetStatusCondition(&st.Conditions, metav1.Condition{
		Type: v1alpha1.ConditionIssuing, Status: metav1.ConditionTrue, Reason: reason, ObservedGeneration: mc.Generation,
		Message: fmt.Sprintf("attempt %d failed: %v; retrying in %s", st.FailedIssuanceAttempts, cause, delay.Round(time.Second/10)),
	})
	r.Events.Eventf(mc, nil, corev1.EventTypeWarning, reason, "Issue", "Attempt %d failed (retrying in %s): %v", st.FailedIssuanceAttempts, delay.Round(time.Second/10), cause)
	r.Logger.Warn("reconcile failed", "namespace", mc.Namespace, "name", mc.Name, "reason", reason, "attempt", st.FailedIssuanceAttempts, "retry_in", delay, "error", cause)
	if err := r.Client.Status().Update(ctx, mc); err != nil && !apierrors.IsConflict(err) {
		return reconcile.Result{}, err
	}
	return reconcile.Result{RequeueAfter: delay}, nil
}

// finalize revokes a deleted resource's certificates (its policy and
// issuer permitting: an offline issuer has nothing to revoke in) and lets
// it go.
func (r *Reconciler) finalize(ctx context.Context, mc *v1alpha1.ManagedCertificate) (reconcile.Result, error) {
	if !controllerutil.ContainsFinalizer(mc, finalizer) {
		return reconcile.Result{}, nil
	}
	ref := mc.Spec.Issuer()
	if mc.Spec.RevocationPolicy != v1alpha1.RevokeNever && ref.SecretName == "" {
		var pending []v1alpha1.PendingRevocation
		for _, p := range mc.Status.PendingRevocations {
			pending = appendPending(pending, v1alpha1.PendingRevocation{SerialNumber: p.SerialNumber, Reason: p.Reason})
		}
		if mc.Status.SerialNumber != "" {
			pending = appendPending(pending, v1alpha1.PendingRevocation{SerialNumber: mc.Status.SerialNumber, Reason: "cessationOfOperation"})
		}
		if len(pending) > 0 {
			iss, err := r.Issuers.forRef(ctx, mc.Namespace, ref)
			if err != nil {
				return r.fail(ctx, mc, false, fmt.Errorf("the certificate of a deleted resource cannot be revoked (set revocationPolicy: Never to delete it without revoking): %w", err))
			}
			for _, p := range pending {
				if !r.revoke(ctx, mc, iss, p.SerialNumber, p.Reason, "the ManagedCertificate was deleted") {
					return r.fail(ctx, mc, false, &issuerError{ReasonIssuerUnavailable, fmt.Errorf("revoking serial %s of a deleted resource failed; retrying (set revocationPolicy: Never to delete it without revoking)", p.SerialNumber)})
				}
			}
		}
	}
	// The Secret, if the garbage collector has not taken it yet, no longer
	// passes for a certificate of this name: a new resource of the same
	// name issues afresh instead of adopting a revoked one.
	if s, err := r.secret(ctx, mc); err == nil && s != nil {
		patch := client.MergeFrom(s.DeepCopy())
		delete(s.Annotations, annotationSpecHash)
		delete(s.Annotations, annotationSerial)
		if err := r.Client.Patch(ctx, s, patch); err != nil && !apierrors.IsNotFound(err) {
			return reconcile.Result{}, err
		}
	}
	r.Metrics.forget(mc.Namespace, mc.Name)
	patch := client.MergeFrom(mc.DeepCopy())
	controllerutil.RemoveFinalizer(mc, finalizer)
	return reconcile.Result{}, client.IgnoreNotFound(r.Client.Patch(ctx, mc, patch))
}

// revokeDue revokes the pending revocations that are due; failures stay
// pending.
func (r *Reconciler) revokeDue(ctx context.Context, mc *v1alpha1.ManagedCertificate, now time.Time) {
	if len(mc.Status.PendingRevocations) == 0 {
		return
	}
	var iss issuer
	var left []v1alpha1.PendingRevocation
	for _, p := range mc.Status.PendingRevocations {
		if now.Before(p.RevokeAfter.Time) {
			left = append(left, p)
			continue
		}
		if iss == nil {
			var err error
			if iss, err = r.Issuers.forRef(ctx, mc.Namespace, mc.Spec.Issuer()); err != nil {
				left = append(left, p)
				continue
			}
		}
		if !r.revoke(ctx, mc, iss, p.SerialNumber, p.Reason, "replaced") {
			p.RevokeAfter = metav1.Time{Time: now.Add(r.RetryMin)}
			left = append(left, p)
		}
	}
	mc.Status.PendingRevocations = left
}

// revoke revokes one certificate, reporting it as an event; false when
// the CA server could not be told (to be retried).
func (r *Reconciler) revoke(ctx context.Context, mc *v1alpha1.ManagedCertificate, iss issuer, serial, reason, why string) bool {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := iss.revoke(ctx, serial, reason)
	switch {
	case errors.Is(err, errNoRevocation):
		return true
	case err != nil:
		r.Metrics.issuanceError(mc.Namespace, mc.Name, "RevocationFailed")
		r.Events.Eventf(mc, nil, corev1.EventTypeWarning, "RevocationFailed", "Revoke", "Revoking serial %s (%s) failed, retrying: %v", serial, why, err)
		r.Logger.Warn("revocation failed", "namespace", mc.Namespace, "name", mc.Name, "serial", serial, "error", err)
		return false
	}
	r.Metrics.revoked()
	r.Events.Eventf(mc, nil, corev1.EventTypeNormal, "Revoked", "Revoke", "Revoked serial %s at %s (%s: %s)", serial, iss, reason, why)
	r.Logger.Info("revoked", "namespace", mc.Namespace, "name", mc.Name, "serial", serial, "reason", reason, "why", why)
	return true
}

// secret reads the resource's Secret (nil when there is none). A Secret
// of that name the operator did not make for this resource's name — no
// label, another resource's, another type, another controller's — is not
// taken over: SecretInUse says what to do.
func (r *Reconciler) secret(ctx context.Context, mc *v1alpha1.ManagedCertificate) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	err := r.Reader.Get(ctx, types.NamespacedName{Namespace: mc.Namespace, Name: mc.Spec.SecretName}, s)
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	owner, ok := s.Labels[labelCertificate]
	switch {
	case !ok:
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s exists and was not made by the operator: delete it, or label it %s=%s to hand it to this resource", s.Name, labelCertificate, mc.Name)}
	case owner != mc.Name:
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s belongs to ManagedCertificate %s: give this one another secretName", s.Name, owner)}
	case s.Type != corev1.SecretTypeTLS:
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s is of type %s, not %s (a type cannot change): delete it", s.Name, s.Type, corev1.SecretTypeTLS)}
	}
	if ref := metav1.GetControllerOf(s); ref != nil && (ref.Kind != "ManagedCertificate" || ref.APIVersion != v1alpha1.GroupVersion.String()) {
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s is controlled by %s %s: give this resource another secretName", s.Name, ref.Kind, ref.Name)}
	}
	return s, nil
}

// desiredSecret is the Secret's metadata as it should be: the template's
// labels and annotations (never the operator's keys), the operator's, and
// this resource as its controller (replacing a deleted resource of the
// same name).
func (r *Reconciler) desiredSecret(mc *v1alpha1.ManagedCertificate, existing *corev1.Secret) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	if existing != nil {
		s = existing.DeepCopy()
	}
	s.Namespace, s.Name, s.Type = mc.Namespace, mc.Spec.SecretName, corev1.SecretTypeTLS
	if s.Labels == nil {
		s.Labels = map[string]string{}
	}
	if s.Annotations == nil {
		s.Annotations = map[string]string{}
	}
	if t := mc.Spec.SecretTemplate; t != nil {
		for k, v := range t.Labels {
			if !strings.HasPrefix(k, operatorPrefix) {
				s.Labels[k] = v
			}
		}
		for k, v := range t.Annotations {
			if !strings.HasPrefix(k, operatorPrefix) {
				s.Annotations[k] = v
			}
		}
	}
	s.Labels[labelCertificate] = mc.Name
	s.OwnerReferences = slices.DeleteFunc(s.OwnerReferences, func(o metav1.OwnerReference) bool {
		return o.Controller != nil && *o.Controller && o.Kind == "ManagedCertificate" && o.UID != mc.UID
	})
	if err := controllerutil.SetControllerReference(mc, s, r.Client.Scheme()); err != nil {
		return nil, &issuerError{ReasonSecretInUse, fmt.Errorf("the Secret %s: %w", s.Name, err)}
	}
	return s, nil
}

// operatorPrefix starts the labels and annotations that are the
// operator's.
const operatorPrefix = "certz.pilab.hu/"

// keepSecretMeta puts back the template's metadata and the owner
// reference on a Secret whose certificate is fine.
func (r *Reconciler) keepSecretMeta(ctx context.Context, mc *v1alpha1.ManagedCertificate, s *corev1.Secret) error {
	want, err := r.desiredSecret(mc, s)
	if err != nil {
		return err
	}
	if maps.Equal(want.Labels, s.Labels) && maps.Equal(want.Annotations, s.Annotations) && slices.EqualFunc(want.OwnerReferences, s.OwnerReferences, func(a, b metav1.OwnerReference) bool { return a.UID == b.UID }) {
		return nil
	}
	return r.Client.Update(ctx, want)
}

// writeSecret creates or updates the Secret in one write (so that a pod
// mounting it sees the new files together).
func (r *Reconciler) writeSecret(ctx context.Context, existing, desired *corev1.Secret) error {
	if existing == nil {
		desired.ResourceVersion = ""
		return r.Client.Create(ctx, desired)
	}
	return r.Client.Update(ctx, desired)
}

func appendPending(s []v1alpha1.PendingRevocation, p v1alpha1.PendingRevocation) []v1alpha1.PendingRevocation {
	if slices.ContainsFunc(s, func(q v1alpha1.PendingRevocation) bool { return q.SerialNumber == p.SerialNumber }) {
		return s
	}
	return append(s, p)
}

func notAfterOf(st *v1alpha1.ManagedCertificateStatus) time.Time {
	if st.NotAfter == nil {
		return time.Time{}
	}
	return st.NotAfter.Time
}

func renewalOf(st *v1alpha1.ManagedCertificateStatus) time.Time {
	if st.RenewalTime == nil {
		return time.Time{}
	}
	return st.RenewalTime.Time
}

// statusEqual compares statuses ignoring conditions' transition times.
func statusEqual(a, b *v1alpha1.ManagedCertificateStatus) bool {
	x, y := a.DeepCopy(), b.DeepCopy()
	for _, st := range []*v1alpha1.ManagedCertificateStatus{x, y} {
		for i := range st.Conditions {
			st.Conditions[i].LastTransitionTime = metav1.Time{}
		}
	}
	return equality.Semantic.DeepEqual(x, y)
}
