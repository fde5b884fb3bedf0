window.autoparErrors=[];
function autoparReport(msg){window.autoparErrors.push(String(msg));var e=document.getElementById('errors');
if(e){e.hidden=false;e.textContent='This page\'s script failed:\n'+window.autoparErrors.join('\n');}}
window.addEventListener('error',function(ev){autoparReport('Uncaught '+(ev.message||ev)+(ev.lineno?' (line '+ev.lineno+')':''));});
window.addEventListener('unhandledrejection',function(ev){autoparReport('Unhandled rejection: '+ev.reason);});
