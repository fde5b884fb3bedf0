(function(){
'use strict';
function cellKey(row,col,num){
  var c=row.cells[col];if(!c){return num?-Infinity:'';}
  var v=c.getAttribute('data-v');if(v===null){v=c.textContent.trim();}
  if(num){var f=parseFloat(v);return isNaN(f)?-Infinity:f;}
  return v.toLowerCase();
}
function sortTable(table,col,dir){
  var th=table.tHead.rows[0].cells[col];if(!th){return false;}
  var num=th.getAttribute('data-type')==='num';
  var body=table.tBodies[0];var rows=Array.prototype.slice.call(body.rows);
  var keyed=rows.map(function(r,i){return {k:cellKey(r,col,num),i:i,r:r};});
  keyed.sort(function(a,b){
    var c=num?(a.k<b.k?-1:a.k>b.k?1:0):(a.k<b.k?-1:a.k>b.k?1:0);
    if(dir==='descending'){c=-c;}
    return c!==0?c:a.i-b.i;
  });
  keyed.forEach(function(x){body.appendChild(x.r);});
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(h){h.removeAttribute('aria-sort');});
  th.setAttribute('aria-sort',dir);
  return true;
}
function columnIndex(table,key){
  var cells=table.tHead.rows[0].cells;
  for(var i=0;i<cells.length;i++){if(cells[i].getAttribute('data-key')===key){return i;}}
  var n=parseInt(key,10);return isNaN(n)?-1:n;
}
function fromHash(){
  var m=/^#sort=([^:]+):([^:]+)(?::(asc|desc))?$/.exec(decodeURIComponent(location.hash||''));
  if(!m){return;}
  var table=document.getElementById(m[1]);if(!table||!table.tHead){return;}
  var col=columnIndex(table,m[2]);if(col<0){return;}
  sortTable(table,col,m[3]==='desc'?'descending':'ascending');
}
var tables=document.querySelectorAll('table.sortable');
Array.prototype.forEach.call(tables,function(table){
  if(!table.tHead||!table.tBodies.length){return;}
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,col){
    th.tabIndex=0;
    th.title=(th.title?th.title+' \u2014 ':'')+'click to sort';
    function go(){
      var dir=th.getAttribute('aria-sort')==='ascending'?'descending':'ascending';
      sortTable(table,col,dir);
      if(table.id&&history.replaceState){
        history.replaceState(null,'','#sort='+table.id+':'+(th.getAttribute('data-key')||col)+':'+(dir==='descending'?'desc':'asc'));
      }
    }
    th.addEventListener('click',go);
    th.addEventListener('keydown',function(ev){if(ev.key==='Enter'||ev.key===' '){ev.preventDefault();go();}});
  });
});
fromHash();
window.addEventListener('hashchange',fromHash);
document.documentElement.setAttribute('data-ready','1');
})();
